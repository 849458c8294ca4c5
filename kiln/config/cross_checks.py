"""KilnConfig's cross-checks of its sub-configs: what MoE models, the KV cache dtype, the memory
of a step and the CPU binding refuse by flag, and the KV cache dtype a checkpoint implies."""
from typing import TYPE_CHECKING

from kiln.errors import ConfigError

if TYPE_CHECKING:
    from kiln.config.kiln_config import KilnConfig


def check_moe(config: "KilnConfig") -> None:
    """What Kiln's mixture-of-experts models (and the non-gated MLP families, LoRA) do not
    run, refused by flag before loading."""
    from kiln.model.registry import (
        MLA_ARCHITECTURES,
        MOE_ARCHITECTURES,
        NO_LORA_ARCHITECTURES,
        causal_architecture,
    )

    m = config.model_config
    family = causal_architecture(m.architecture)  # a classifier: its backbone's
    if config.lora_config is not None and family in NO_LORA_ARCHITECTURES:
        raise ConfigError(f"--enable-lora: LoRA adapters on {m.architecture} are not "
                          "supported (Kiln applies them to q/k/v/o and gate/up/down "
                          "projections; its MLP is a non-gated c_fc / c_proj); drop "
                          "--enable-lora")
    if family not in MOE_ARCHITECTURES:
        return
    if m.architecture in MLA_ARCHITECTURES and m.quant_kind is not None:
        raise ConfigError(f"quantization {m.quantization!r}: quantized {m.architecture} "
                          "(latent attention, DeepSeek's experts) is not supported; use a "
                          "float checkpoint and drop --quantization")
    if m.quant_kind == "fp8":  # int8 (online, compressed-tensors W8A8) runs the experts
        raise ConfigError(f"--quantization {m.quantization}: Kiln has no fp8 kernel for the "
                          f"expert weights of {m.architecture} (a mixture of experts, where "
                          "they are most of the model); use --quantization int8 or drop it")
    if m.quant_kind == "int4":
        raise ConfigError(f"quantization_config ({m.quantization}): 4-bit weight-only "
                          f"experts of {m.architecture} (a mixture of experts) are not "
                          "supported; use a W8A8 int8 or a float checkpoint")
    if config.lora_config is not None:
        raise ConfigError(f"--enable-lora: LoRA adapters on {m.architecture} (a mixture of "
                          "experts) are not supported; drop --enable-lora")


def resolve_cache_dtype(config: "KilnConfig") -> None:
    """--kv-cache-dtype auto over a compressed-tensors checkpoint with a kv_cache_scheme:
    an fp8 cache with its scales, as vLLM serves one (kv_cache_scales.py). Only the
    target's checkpoint decides: a draft writes into the caches the target's dtype sized,
    so a draft's own kv_cache_scheme left its layers reading fp8 from a float cache."""
    from kiln.attention.kv_cache_scales import checkpoint_cache_dtype
    from kiln.logger import init_logger

    if config.is_draft:
        return
    cache, m = config.cache_config, config.model_config
    resolved = checkpoint_cache_dtype(cache.cache_dtype,
                                      getattr(m.hf_config, "quantization_config", None))
    if resolved != cache.cache_dtype and m.is_mla:
        # no fp8 latent cache (check_kv_cache_dtype), and no flag would undo the fp8
        init_logger(__name__).warning(
            "the checkpoint's kv_cache_scheme quantizes the KV cache, but %s's MLA latent "
            "cache has no fp8 form in Kiln: it runs in the model dtype, its scales unused",
            m.architecture)
        return
    if resolved != cache.cache_dtype:
        init_logger(__name__).info(
            "--kv-cache-dtype auto: the checkpoint's kv_cache_scheme quantizes the KV cache, "
            "which runs in %s with its per-layer scales (as vLLM does)", resolved)
        cache.cache_dtype = resolved


def check_kv_cache_dtype(config: "KilnConfig") -> None:
    """An fp8 KV cache where it is not built is refused by flag."""
    m, name = config.model_config, config.cache_config.cache_dtype
    if name == "auto":
        return
    if m.is_mla:
        raise ConfigError(f"--kv-cache-dtype {name}: an fp8 KV cache for {m.architecture}'s "
                          "MLA latent cache is not supported; use --kv-cache-dtype auto")
    # a checkpoint's KV scales: kv_cache_scheme checked where its quantization config is
    # read (compressed_tensors.py), the k_scale / v_scale tensors by the Attention layers
    quant = getattr(m.hf_config, "quantization_config", None) or {}
    if not isinstance(quant, dict):
        quant = quant.to_dict()
    if name == "fp8_e5m2" and quant.get("kv_cache_scheme"):
        raise ConfigError("--kv-cache-dtype fp8_e5m2: the checkpoint's kv_cache_scheme "
                          "gives e4m3 KV cache scales (vLLM refuses e5m2 with them too); "
                          "use --kv-cache-dtype fp8")


def check_memory(config: "KilnConfig") -> None:
    """Sizes whose buffers no machine here could hold are refused by flag, before anything
    is built (they failed deep in an allocation, or got the core killed minutes later)."""
    from kiln.config import memory_estimate as mem
    from kiln.platforms import for_device

    m, s, c = config.model_config, config.scheduler_config, config.cache_config
    needs = {f"--max-num-seqs {s.max_num_seqs} x --max-model-len {m.max_model_len}":
             mem.batch_table_bytes(s.max_num_seqs, m.max_model_len, c.block_size)}
    if config.device_config.device == "cpu":  # a GPU's step buffers are on the GPU
        intermediate = getattr(m.hf_config, "intermediate_size", None) or 4 * m.hidden_size
        needs[f"--max-num-batched-tokens {s.max_num_batched_tokens}"] = \
            mem.activation_bytes(s.max_num_batched_tokens, m.hidden_size, intermediate)
        needs[f"--max-num-seqs {s.max_num_seqs} x the vocabulary ({m.vocab_size})"] = \
            mem.logits_bytes(s.max_num_seqs, m.vocab_size)
        if c.num_gpu_blocks_override is not None:
            block = mem.kv_block_bytes(c.block_size, m.num_layers, m.num_kv_heads,
                                       m.head_dim, c.torch_cache_dtype(m.torch_dtype).itemsize,
                                       m.kv_cache_parts)
            needs[f"--num-gpu-blocks-override {c.num_gpu_blocks_override}"] = \
                c.num_gpu_blocks_override * block
    dp = config.parallel_config.data_parallel_size  # every replica has its own buffers
    if dp > 1:
        needs = {f"{k} x --data-parallel-size {dp}": v * dp for k, v in needs.items()}
    mem.check_fits(needs, for_device("cpu").mem_get_info()[1])


def check_binding(config: "KilnConfig") -> None:
    """KILN_CPU_OMP_THREADS_BIND pins the ranks of a multi-process CPU engine on this
    machine: checked here, before they start; a one-process engine does not read it."""
    from kiln import envs
    from kiln.distributed.cpu_binding import check_binding
    from kiln.logger import init_logger

    bind, pc = envs.cpu_omp_threads_bind(), config.parallel_config
    if config.device_config.device != "cpu":
        return
    dp = pc.data_parallel_size  # a replica's one-process engine is pinned to its list
    if pc.distributed_executor_backend == "mp" or (dp > 1 and bind != "auto"):
        check_binding(bind, pc.world_size, dp)
    if pc.distributed_executor_backend in ("mp", "ray"):
        if envs.cpu_num_reserved_cpu(default=0):  # set, and read by no rank: said so
            init_logger(__name__).warning(
                "%s=%d is ignored: it thins a one-process engine's threads, and this "
                "one's ranks run on the cores %s gives them (%r); list cores that leave "
                "some free", envs.source("KILN_CPU_NUM_OF_RESERVED_CPU"),
                envs.cpu_num_reserved_cpu(default=0), envs.source("KILN_CPU_OMP_THREADS_BIND"),
                bind)
    elif pc.distributed_executor_backend == "uni" and bind != "auto" and dp == 1:
        init_logger(__name__).warning(
            "%s=%r is ignored: it pins the ranks of a multi-process "
            "engine (tensor or pipeline parallel), and this one runs in one process "
            "(OMP_NUM_THREADS and taskset set its threads and cores)",
            envs.source("KILN_CPU_OMP_THREADS_BIND"), bind)
