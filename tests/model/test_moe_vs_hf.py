"""Mixtral, Qwen2-MoE (shared expert, a dense layer) and Qwen3-MoE (norm_topk_prob) against HF
transformers on tiny random checkpoints (float32, 4 experts, top 2): logits of a prefill and of
decode steps through the paged cache within 1e-4; through LLM, greedy tokens equal HF's and their
logprobs HF's log-softmax within 1e-4, eager (mode 0) and compiled (mode 3, one Dynamo graph, the
MoE op kept whole); transformers 5's fused expert tensors load; what the families refuse (fp8,
LoRA), refused by flag.
"""
import pytest
import torch

from kiln import LLM, SamplingParams
from kiln.compilation.counters import compilation_counter
from kiln.errors import ConfigError
from kiln.model.loader import build_model, get_model
from model._attn_helper import (
    BlockPool,
    PagedRequest,
    allocate_kv_caches,
    build_step,
    kiln_config_for,
    run_step,
)

TOL = 1e-4
PROMPTS = [[5, 6, 7, 8, 9], [300, 301, 302, 40, 41, 42, 43, 44, 45, 46, 47], [77]]
MAX_TOKENS = 8


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _hf(ckpt_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(ckpt_dir, dtype=torch.float32).eval()


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_prefill_and_decode_logits_match_hf(arch, request):
    _assert_logits_match_hf(request.getfixturevalue(f"tiny_{arch}_dir"))


@pytest.mark.parametrize("arch", ["mixtral", "qwen2_moe"])
def test_transformers_5_fused_expert_checkpoints_load(arch, request, tmp_path):
    """transformers 5 keeps a layer's experts as two 3-D tensors (experts.gate_up_proj,
    experts.down_proj) and writes them so with save_original_format=False (and newer hub
    checkpoints ship them): Kiln refused them as 'matches no parameter ... does not match its
    config', where transformers and vLLM load them."""
    src = request.getfixturevalue(f"tiny_{arch}_dir")
    hf = _hf(src)
    hf.save_pretrained(tmp_path, save_original_format=False)
    from safetensors import safe_open

    with safe_open(tmp_path / "model.safetensors", "pt") as f:
        assert "model.layers.0.mlp.experts.gate_up_proj" in f.keys()
    _assert_logits_match_hf(tmp_path, hf)


def test_a_fused_expert_tensor_of_the_wrong_rank_is_named():
    from kiln.model.checkpoint_names import split_fused_experts

    with pytest.raises(ConfigError, match=r"model.layers.0.mlp.experts.gate_up_proj has shape "
                       r"\(8, 64\), expected \[experts, 2 x intermediate, hidden\]"):
        split_fused_experts("model.layers.0.mlp.experts.gate_up_proj", torch.zeros(8, 64))
    assert split_fused_experts("model.layers.0.mlp.gate.weight", torch.zeros(4, 64)) is None


def _native_calls() -> int:
    """Calls of the native float experts kernel so far (csrc/moe_experts.cpp), -1 without it."""
    from kiln.native import build

    return torch.ops.kiln.fused_experts_calls() if build.available() else -1


def _assert_native_ran(before: int) -> None:
    """The native kernel ran (KILN_REQUIRE_NATIVE=1, as the suite runs, makes it the one built)."""
    assert before == -1 or _native_calls() > before


def _assert_logits_match_hf(ckpt_dir, hf=None):
    cfg = kiln_config_for(ckpt_dir)
    model = get_model(cfg)
    calls = _native_calls()
    allocate_kv_caches(model, cfg, 32, 4)
    seq = _tokens(22, seed=1)
    with torch.no_grad():
        ref = (hf or _hf(ckpt_dir))(torch.tensor([seq])).logits[0]  # [S, V]
    pool, req = BlockPool(32, 4), PagedRequest(seq)
    ids, pos, md = build_step(pool, [req], [18])
    assert (run_step(model, cfg, ids, pos, md) - ref[:18]).abs().max() < TOL
    for p in range(18, 22):
        ids, pos, md = build_step(pool, [req], [1])
        assert (run_step(model, cfg, ids, pos, md)[0] - ref[p]).abs().max() < TOL
    _assert_native_ran(calls)


def _generate(llm: LLM):
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [o.outputs[0] for o in outs]


def _check_against_hf(outputs, ckpt_dir):
    """Greedy tokens equal HF's; each token's logprob HF's log-softmax within TOL."""
    from checkpoints import hf_greedy

    assert [list(o.token_ids) for o in outputs] == hf_greedy(ckpt_dir, PROMPTS, MAX_TOKENS)
    hf = _hf(ckpt_dir)
    for prompt, out in zip(PROMPTS, outputs):
        seq = prompt + list(out.token_ids)
        with torch.no_grad():
            logprobs = torch.log_softmax(hf(torch.tensor([seq])).logits[0].double(), -1)
        for i, (token, step) in enumerate(zip(out.token_ids, out.logprobs)):
            want = logprobs[len(prompt) - 1 + i, token].item()
            assert abs(step[token].logprob - want) < TOL


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_eager_greedy_and_logprobs_match_hf(arch, request, inprocess_core):
    ckpt_dir = request.getfixturevalue(f"tiny_{arch}_dir")
    calls = _native_calls()
    llm = LLM(model=str(ckpt_dir), dtype="float32", enforce_eager=True, max_model_len=64)
    _check_against_hf(_generate(llm), ckpt_dir)
    _assert_native_ran(calls)


def test_qwen2_moe_mode3_traces_one_graph_and_matches_hf(tiny_qwen2_moe_dir, tmp_path,
                                                         inprocess_core):
    from kiln.compilation.passes import lower_ir

    lower_ir.reset_record()
    calls = _native_calls()
    # 2 attention layers: 5 pieces from one Dynamo graph (a graph break would make more graphs)
    with compilation_counter.expect(num_graphs_seen=1, num_piecewise_graphs_seen=5):
        llm = LLM(model=str(tiny_qwen2_moe_dir), dtype="float32", max_model_len=64,
                  compilation_config={"mode": 3, "cache_dir": str(tmp_path / "cc")})
    # the op stays one node (its shapes depend on the routing), run by the native provider
    # (kiln/ir/moe_native.py) where the kernels are built: one C++ call a layer
    from kiln.native import build

    assert lower_ir.lowered_providers()["fused_moe"] == {"native" if build.available() else
                                                         "torch"}
    _check_against_hf(_generate(llm), tiny_qwen2_moe_dir)
    _assert_native_ran(calls)


@pytest.mark.parametrize("method", ["fp8", "ptpc_fp8"])
def test_fp8_is_refused_for_experts(tiny_mixtral_dir, method):
    with pytest.raises(ConfigError, match=f"--quantization {method}: Kiln has no fp8 kernel for "
                                          "the expert weights of MixtralForCausalLM.*use "
                                          "--quantization int8"):
        kiln_config_for(tiny_mixtral_dir, quantization=method)


def test_int8_is_accepted_for_experts(tiny_mixtral_dir):
    # runs the experts through fused_moe_int8 (tests/quantization/test_moe_int8.py)
    assert kiln_config_for(tiny_mixtral_dir, quantization="int8").model_config.quant_kind == "int8"


def test_lora_is_refused(tiny_mixtral_dir):
    from kiln.config import DeviceConfig, KilnConfig, ModelConfig
    from kiln.lora.config import LoRAConfig

    with pytest.raises(ConfigError, match="--enable-lora: LoRA adapters on MixtralForCausalLM"):
        KilnConfig(ModelConfig(model=str(tiny_mixtral_dir)), device_config=DeviceConfig("cpu"),
                   enforce_eager=True, lora_config=LoRAConfig())


def test_a_missing_expert_tensor_is_named(tiny_mixtral_dir):
    from safetensors.torch import load_file

    cfg = kiln_config_for(tiny_mixtral_dir)
    model = build_model(cfg)
    weights = load_file(tiny_mixtral_dir / "model.safetensors")
    del weights["model.layers.1.block_sparse_moe.experts.3.w3.weight"]
    with pytest.raises(ConfigError, match=r"missing 1 parameter\(s\): model\.layers\.1\.mlp\."
                                          r"experts\.w13_weight \(shard expert 3 w3\)"):
        model.load_weights(weights.items())
