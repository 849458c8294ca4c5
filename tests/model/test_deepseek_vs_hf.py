"""DeepSeek-V2 (no q LoRA, group_limited_greedy, layer 0 dense; with a q LoRA, greedy routing and
YaRN) and V3 (noaux_tc, a routing bias, renormalized, q LoRA; rope halves without rope_interleave)
against HF transformers on tiny random float32 checkpoints: logits of a prefill and of decode
steps through the latent paged cache (prefill expanded, decode weight-absorbed) within 1e-4
(TOL; measured 2.2e-6 at most); through LLM compiled (mode 3), V2's greedy tokens equal HF's and
their logprobs HF's log-softmax within 1e-4; V3's in mode 0 with prefix caching and chunked
prefill, float32 and bfloat16 (and under tensor parallelism: tests/distributed/
test_tp_deepseek.py); the cache one latent row per token and layer; MTP layers skipped on load;
HF's empty shared MLP (n_shared_experts 0) loads; a bfloat16 model's router is HF's float32 one;
the softmax scale's mscale_all_dim is HF's; what the family refuses, by field.
"""
import shutil

import pytest
import torch

from kiln import LLM
from kiln.errors import ConfigError
from kiln.model.loader import get_model
from model._attn_helper import kiln_config_for
from model.test_moe_vs_hf import _assert_logits_match_hf, _check_against_hf, _generate

ARCHS = ["deepseek_v2", "deepseek_v2_yarn", "deepseek_v3"]


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_and_decode_logits_match_hf(arch, request):
    _assert_logits_match_hf(request.getfixturevalue(f"tiny_{arch}_dir"))


def test_v3_without_rope_interleave_matches_hf(tmp_path):
    """rope_interleave false: each head's rope halves rotate together (Llama's form)."""
    from checkpoints import make_tiny_checkpoint

    _assert_logits_match_hf(make_tiny_checkpoint(tmp_path, "deepseek_v3", tie=False,
                                                 rope_interleave=False))


def test_v2_mode3_greedy_and_logprobs_match_hf(tiny_deepseek_v2_dir, inprocess_core):
    """Traced whole (Dynamo, Kiln's passes, the piecewise split); the eager backend keeps
    Inductor's minute of compiling out of the suite."""
    llm = LLM(model=str(tiny_deepseek_v2_dir), dtype="float32", max_model_len=64,
              compilation_config={"mode": 3, "backend": "eager"})
    _check_against_hf(_generate(llm), tiny_deepseek_v2_dir)


def _with_extra_layer(src, dst, index: int):
    """A copy of checkpoint `src` with layer 2's tensors stored again as layer `index`."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    tensors.update({k.replace("model.layers.2.", f"model.layers.{index}."): v.clone()
                    for k, v in tensors.items() if k.startswith("model.layers.2.")})
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_mtp_layers_are_skipped_and_a_layer_past_them_refused(tiny_deepseek_v3_dir, tmp_path):
    """V3 checkpoints store num_nextn_predict_layers MTP layers after the decoder's: Kiln refused
    them as tensors of no layer; they are skipped (as vLLM without speculation)."""
    get_model(kiln_config_for(_with_extra_layer(tiny_deepseek_v3_dir, tmp_path / "mtp", 3)))
    with pytest.raises(ConfigError, match=r"model.layers.4.* num_hidden_layers=3"):
        get_model(kiln_config_for(_with_extra_layer(tiny_deepseek_v3_dir, tmp_path / "x", 4)))


def _config(**fields):
    from transformers import DeepseekV3Config

    from checkpoints import ARCH_CONFIGS

    return DeepseekV3Config(hidden_size=64, num_attention_heads=4, vocab_size=512,
                            **{**ARCH_CONFIGS["deepseek_v3"][1], **fields})


@pytest.mark.parametrize("fields, what", [
    (dict(topk_method="sinkhorn"), "topk_method 'sinkhorn' is not supported"),
    (dict(scoring_func="relu"), "scoring_func 'relu' is not supported"),
    (dict(n_group=3), r"n_group \(3\) must divide n_routed_experts \(8\)"),
    (dict(topk_group=5), r"topk_group \(5\) must be between 1 and n_group \(4\)"),
    (dict(num_experts_per_tok=6), r"num_experts_per_tok \(6\) is more than"),
])
def test_routing_settings_kiln_cannot_run_are_refused_by_field(fields, what):
    from kiln.model.layers.deepseek_routing import routing_of

    with pytest.raises(ConfigError, match=what):
        routing_of(_config(**fields), v3=True)


def test_routing_matches_hf_router():
    """noaux_tc and group_limited_greedy against HF's routers (the same weights chosen)."""
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    from kiln.model.layers.deepseek_routing import deepseek_topk, routing_of

    from checkpoints import ARCH_CONFIGS

    torch.manual_seed(0)
    x = torch.randn(16, 64)
    v2 = DeepseekV2Config(hidden_size=64, num_attention_heads=4, **ARCH_CONFIGS["deepseek_v2"][1])
    for config, router_cls, v3 in ((v2, DeepseekV2TopkRouter, False),
                                   (_config(), DeepseekV3TopkRouter, True)):
        router = router_cls(config)
        torch.nn.init.normal_(router.weight)
        bias = getattr(router, "e_score_correction_bias", None)
        if bias is not None:
            bias.normal_(0, 0.1)
        logits, want_w, want_ids = router(x)
        got_w, got_ids = deepseek_topk(logits, routing_of(config, v3), bias)
        want = torch.zeros(16, 8).scatter_(1, want_ids, want_w)
        assert torch.allclose(torch.zeros(16, 8).scatter_(1, got_ids, got_w), want)


def test_cache_holds_the_latent_and_rope_per_token(tiny_deepseek_v2_dir):
    """vLLM's MLA layout: per token per layer one row of kv_lora_rank (32) + qk_rope_head_dim
    (8) values and no V, on whichever backend is chosen: what the model config reports, the
    tensor each layer gets and the bytes a block costs (the expanded cache: 4 heads x 24 x 2)."""
    from kiln.attention.mla_backend import LatentAttentionImpl
    from kiln.config.memory_estimate import kv_block_bytes
    from kiln.core.kv_cache_groups import single_group
    from kiln.model.layers.attention import attention_layers
    from kiln.worker import kv_cache_layout

    cfg = kiln_config_for(tiny_deepseek_v2_dir)
    m = cfg.model_config
    assert (m.num_kv_heads, m.head_dim, m.kv_cache_parts, m.use_mla) == (1, 40, 1, True)
    layers = list(attention_layers(get_model(cfg)).values())
    assert all(isinstance(layer.impl, LatentAttentionImpl) for layer in layers)
    shapes = {layer.backend.get_kv_cache_shape(7, 4, layer.num_kv_heads, layer.head_size)
              for layer in layers}
    assert shapes == {(1, 7, 4, 1, 40)}
    groups = single_group([None] * len(layers))
    block = kv_cache_layout.block_bytes(layers, groups, 4, torch.float32)
    assert block == 3 * 4 * 40 * 4
    # the start-up estimate (--num-gpu-blocks-override's fit) counts the same bytes
    assert kv_block_bytes(4, m.num_layers, m.num_kv_heads, m.head_dim, 4, m.kv_cache_parts) == block


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_v3_eager_prefix_caching_and_chunked_prefill_match_hf(tiny_deepseek_v3_dir, dtype):
    """Through LLM in mode 0, prompts of 27-30 tokens prefilled in chunks of at most 16 (a
    chunk's queries against K/V expanded from the latent cached by the chunks before it), the
    second and third prompts' first 24 tokens read from the first's cached blocks, then decoded
    together (unequal lengths: padded keys masked): HF's greedy tokens in the same dtype (in
    bfloat16 HF too expands K/V from the bfloat16 latent)."""
    from kiln import SamplingParams

    from checkpoints import hf_greedy

    base = [(7 * i + 3) % 500 for i in range(24)]
    prompts = [base + [11, 12, 13, 14, 15, 16], base + [400, 401, 402, 403, 404, 405],
               base + [9, 8, 7]]
    llm = LLM(model=str(tiny_deepseek_v3_dir), dtype=dtype, enforce_eager=True,
              max_model_len=64, block_size=8, enable_prefix_caching=True,
              max_num_batched_tokens=16, max_num_seqs=4)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    first = llm.generate([{"prompt_token_ids": prompts[0]}], params, use_tqdm=False)
    rest = llm.generate([{"prompt_token_ids": p} for p in prompts[1:]], params, use_tqdm=False)
    assert [o.num_cached_tokens for o in rest] == [24, 24]
    got = [list(o.outputs[0].token_ids) for o in first + rest]
    assert got == hf_greedy(tiny_deepseek_v3_dir, prompts, 6, dtype=getattr(torch, dtype))


def test_quantization_is_refused(tiny_deepseek_v2_dir):
    with pytest.raises(ConfigError, match="quantization 'int8': quantized DeepseekV2ForCausalLM"):
        kiln_config_for(tiny_deepseek_v2_dir, quantization="int8")


def test_fused_moe_runs_a_given_routing():
    """fused_moe's topk_weights / topk_ids (DeepSeek's routing) replace its softmax top-k, in
    the reference, its CUDA-graph form and the native provider: the same sum of each token's
    chosen experts by the given weights."""
    from kiln import ir
    from kiln.ir.moe import _fused_moe_dense
    from kiln.ir.moe_native import _fused_moe_native, _fused_moe_supported

    torch.manual_seed(0)
    x, logits = torch.randn(5, 32), torch.randn(5, 6)
    w13, w2 = torch.randn(6, 48, 32) * 0.2, torch.randn(6, 32, 24) * 0.2
    weights, ids = torch.rand(5, 2) * 2, torch.stack([torch.randperm(6)[:2] for _ in range(5)])
    want = torch.zeros(5, 32)
    for t in range(5):
        for w, e in zip(weights[t], ids[t]):
            gate, up = (x[t] @ w13[e].T).chunk(2)
            want[t] += w * ((torch.nn.functional.silu(gate) * up) @ w2[e].T)
    args = (x, logits, w13, w2, 2, True, weights, ids)
    assert torch.allclose(ir.fused_moe.reference(*args), want, atol=1e-5)
    assert torch.allclose(_fused_moe_dense(*args), want, atol=1e-5)
    if _fused_moe_supported(*args):  # where the native kernels are built
        assert torch.allclose(_fused_moe_native(*args), want, atol=1e-5)


def test_no_shared_experts_loads_hf_checkpoint(tmp_path):
    """n_shared_experts 0: HF saves each MoE layer's shared MLP with 0 rows and adds nothing;
    Kiln refused the empty tensors as matching no parameter."""
    from checkpoints import make_tiny_checkpoint

    _assert_logits_match_hf(make_tiny_checkpoint(tmp_path, "deepseek_v2", tie=False,
                                                 n_shared_experts=0))


@pytest.mark.parametrize("params", [
    {"rope_type": "yarn", "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 1.0,
     "original_max_position_embeddings": 4096},
    {"rope_type": "linear", "factor": 4.0, "mscale_all_dim": 0.707},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128},
    {"rope_type": "default"},
])
def test_softmax_mscale_is_hfs(params):
    """mscale_all_dim scales the softmax under any rope scaling (HF's yarn_apply_mscale, and
    vLLM): Kiln scaled it under yarn only, so a linear one's tokens differed from HF's."""
    from transformers.modeling_rope_utils import yarn_apply_mscale

    from kiln.model.layers.yarn import yarn_softmax_mscale

    assert yarn_softmax_mscale(params) == pytest.approx(yarn_apply_mscale(params, 1.0))


def test_bfloat16_router_is_hfs_float32_one(tiny_deepseek_v3_dir):
    """In a bfloat16 model the router runs in float32 on a float32 gate, as HF's (it keeps
    gate.weight float32) and vLLM's: Kiln rounded its logits to bfloat16, which moved every
    routing weight (and flipped near-tied expert choices)."""
    from transformers import AutoModelForCausalLM

    model = get_model(kiln_config_for(tiny_deepseek_v3_dir, dtype="bfloat16"))
    hf = AutoModelForCausalLM.from_pretrained(tiny_deepseek_v3_dir, dtype=torch.bfloat16)
    torch.manual_seed(0)
    x = torch.randn(16, 64).to(torch.bfloat16)
    with torch.no_grad():
        want = hf.model.layers[1].mlp.gate(x)[0]
        got = model.model.layers[1].mlp.router_logits(x)
    assert got.dtype == torch.float32 and torch.allclose(got, want, atol=1e-6)
