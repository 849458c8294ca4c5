"""W8A8 fp8 (e4m3) on CPU, where its IR ops run their torch references: quantization error
within e4m3's half step, the GEMM reference against torch._scaled_mm's row-wise kernel, and
online `quantization="fp8"` / `"ptpc_fp8"` engines: weights stored as e4m3, the same greedy
tokens in modes 0 and 3, logprobs near the float model's. tests/gpu/test_w8a8_gpu.py runs the
`cuda` provider (torch._scaled_mm) on a GPU; its calling code also runs here, on torch's CPU
kernel."""
import pytest
import torch

from kiln import LLM, SamplingParams
from kiln.benchmarks.engine_probe import engine_model
from kiln.ir import quant_fp8
from kiln.model.layers.linear import LinearBase
from kiln.model.layers.quantization.fp8 import quantize_weight_fp8

from checkpoints import random_prompts

FP8 = torch.float8_e4m3fn


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dynamic_quant_is_within_half_an_e4m3_step(dtype):
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(7, 96, generator=g) * torch.logspace(-3, 2, 7)[:, None]).to(dtype)
    x[3] = 0
    q, scale = quant_fp8.dynamic_fp8_quant.reference(x)
    assert q.dtype == FP8 and q.shape == x.shape and scale.shape == (7, 1)
    assert scale[3].item() == 1.0 and q[3].float().abs().max().item() == 0
    x32 = x.float()
    assert torch.allclose(q.float().abs().amax(-1), torch.where(
        x32.abs().amax(-1) > 0, torch.full((7,), 448.0), torch.zeros(7)))  # the row's max hits 448
    err = (q.float() * scale - x32).abs()
    # e4m3: 3 mantissa bits (half step 2^-4 relative); below 2^-6 subnormals step 2^-9
    assert (err <= x32.abs() * 2 ** -4 + scale * 2 ** -10).all()


def test_a_row_whose_scale_underflows_quantizes_to_zeros_not_nan():
    """amax / 448 is 0 in float32 below 6e-43 (denormal activations or weight rows): the row
    divided by it gave NaN (0 / 0), and NaN for the whole row of the GEMM's output."""
    x = torch.tensor([[1e-44, 0.0, -5e-45, 0.0], [1.0, -2.0, 0.5, 0.0]])
    q, scale = quant_fp8.dynamic_fp8_quant.reference(x)
    assert not q.float().isnan().any() and scale[0].item() == 1.0
    out = quant_fp8.fp8_scaled_mm.reference(q, scale, torch.ones(3, 4).to(FP8), torch.ones(3),
                                            None, torch.float32)
    assert out[0].abs().max().item() < 1e-30 and torch.equal(out[1], torch.full((3,), -0.5))


def _cpu_rowwise_scaled_mm() -> bool:
    """Whether torch's CPU _scaled_mm takes row-wise scales (2.13 does; 2.11 takes per-tensor
    scales only)."""
    w = torch.ones(1, 16).to(FP8)
    try:  # two rows, a scale each
        torch._scaled_mm(torch.ones(2, 16).to(FP8), w.t(), scale_a=torch.ones(2, 1),
                         scale_b=torch.ones(1, 1), out_dtype=torch.float32)
    except RuntimeError:
        return False
    return True


def test_gemm_reference_matches_torch_scaled_mm_rowwise():
    g = torch.Generator().manual_seed(1)
    x, w = torch.randn(10, 64, generator=g), torch.randn(48, 64, generator=g)
    q, scale = quant_fp8.dynamic_fp8_quant.reference(x)
    w_q, w_scale = quantize_weight_fp8(w, per_channel=True)
    bias = torch.randn(48, generator=g)
    ref = quant_fp8.fp8_scaled_mm.reference(q, scale, w_q, w_scale, bias, torch.float32)
    if _cpu_rowwise_scaled_mm():
        other = torch._scaled_mm(q, w_q.t(), scale_a=scale, scale_b=w_scale.reshape(1, -1),
                                 out_dtype=torch.float32) + bias
    else:  # torch's kernel for the products and sums, the row and column scales after
        one = torch.ones(())
        other = torch._scaled_mm(q, w_q.t(), scale_a=one, scale_b=one, out_dtype=torch.float32)
        other = other * scale * w_scale.reshape(1, -1) + bias
    assert torch.allclose(ref, other, rtol=1e-5, atol=1e-4)
    # and it approximates the float GEMM: e4m3's error on both operands
    assert (ref - (x @ w.t() + bias)).abs().max() < 0.1 * (x @ w.t()).abs().max()


@pytest.mark.parametrize("k", [64, 40])
def test_the_cuda_providers_call_runs_on_cpu_tensors(k):
    """The `cuda` provider's own code (operand layout, scale shapes, the bias added after, the
    reference for a layer off the 16-wide tiles) run through torch._scaled_mm's CPU kernel:
    the GPU test checks its numerics on hardware this suite may never see."""
    if k % 16 == 0 and not _cpu_rowwise_scaled_mm():
        pytest.skip("torch's CPU _scaled_mm takes per-tensor scales only (torch < 2.13)")
    g = torch.Generator().manual_seed(2)
    x = torch.randn(9, k, generator=g).to(torch.bfloat16)
    q, scale = quant_fp8.dynamic_fp8_quant.reference(x)
    w_q, w_scale = quantize_weight_fp8(torch.randn(48, k, generator=g), per_channel=True)
    bias = torch.randn(48, generator=g).to(torch.bfloat16)
    args = (q, scale, w_q, w_scale, bias, torch.bfloat16)
    got = quant_fp8.fp8_scaled_mm.impls["cuda"].fn(*args)
    ref = quant_fp8.fp8_scaled_mm.reference(*args)
    assert got.dtype == torch.bfloat16 and got.shape == (9, 48)
    if k % 16:
        assert torch.equal(got, ref)  # off the tiles: the reference itself
    else:
        # the bias is added in bfloat16 after the GEMM's rounding, not in float32 before one
        # rounding: within two bfloat16 steps of the largest output
        assert torch.allclose(got.float(), ref.float(), rtol=0, atol=2 ** -6 * ref.abs().max())


def test_per_tensor_weights_share_one_scale():
    w = torch.randn(32, 64)
    q, scale = quantize_weight_fp8(w, per_channel=False)
    assert q.shape == w.shape and scale.shape == (32,) and torch.all(scale == scale[0])
    assert scale[0].item() == pytest.approx(w.abs().max().item() / 448)


def _generate(model_dir, quantization, mode, tmp_path, backend="inductor"):
    llm = LLM(model=str(model_dir), dtype="float32", quantization=quantization,
              max_num_batched_tokens=64, kv_cache_memory=0.05,
              compilation_config={"mode": mode, "backend": backend,
                                  "cache_dir": str(tmp_path / "cc")})
    prompts = random_prompts(3, [5, 30, 70], seed=3)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    model = engine_model(llm.llm_engine)
    llm.shutdown()
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    logprobs = [[next(iter(s.values())).logprob for s in o.outputs[0].logprobs] for o in outs]
    return tokens, logprobs, model


@pytest.mark.usefixtures("inprocess_core")  # reads the loaded model
# ptpc_fp8 calls the same two IR ops as fp8 (per-token scales are their arguments): Inductor
# lowers them in the fp8 case; ptpc's mode 3 runs the piecewise graph on the eager backend.
@pytest.mark.parametrize("quantization, backend", [("fp8", "inductor"), ("ptpc_fp8", "eager")])
def test_online_fp8_modes_0_and_3_agree(tiny_llama_dir, tmp_path, quantization, backend):
    eager, eager_lp, model = _generate(tiny_llama_dir, quantization, 0, tmp_path)
    linears = [m for m in model.modules() if isinstance(m, LinearBase)]
    assert linears and all(m.weight.dtype == FP8 for m in linears)
    compiled, compiled_lp, _ = _generate(tiny_llama_dir, quantization, 3, tmp_path, backend)
    assert compiled == eager
    assert max(abs(a - b) for ra, rb in zip(eager_lp, compiled_lp) for a, b in zip(ra, rb)) < 1e-3
    _, float_lp, _ = _generate(tiny_llama_dir, None, 0, tmp_path)
    # The first token's logprob (the same context as the float model's): e4m3 weights and
    # activations move it, by little
    first = [abs(a[0] - b[0]) for a, b in zip(eager_lp, float_lp)]
    assert 0 < max(first) < 0.3


def test_fp8_on_a_quantized_checkpoint_is_refused():
    from kiln.model.layers.quantization import resolve_quantization

    class Quantized:
        quantization_config = {"quant_method": "compressed-tensors"}

    with pytest.raises(ValueError, match="already quantized"):
        resolve_quantization("fp8", Quantized())


def test_online_fp8_on_a_gguf_file_lets_the_blocks_go(tiny_llama_dir, tmp_path):
    """The fp8 GEMM reads only the e4m3 weight: a GGUF file's blocks go with the float weight,
    as under int8 (they stayed attached to every linear)."""
    from model._attn_helper import kiln_config_for
    from model.test_gguf_vs_hf import write_gguf

    from kiln.model.layers import cpu_gemm
    from kiln.model.loader import get_model
    from kiln.native import linear_op

    types = {part: "Q8_0" for part in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate",
                                       "ffn_up", "ffn_down")}
    path = write_gguf(tmp_path / "tiny.gguf", tiny_llama_dir, types=types)
    if linear_op.available():  # else no blocks are kept at all
        float_layers = [m for m in get_model(kiln_config_for(path)).modules()
                        if isinstance(m, LinearBase)]
        assert all(cpu_gemm.held(m).blocks for m in float_layers)
    layers = [m for m in get_model(kiln_config_for(path, quantization="fp8")).modules()
              if isinstance(m, LinearBase)]
    assert layers and all(m.weight.dtype == FP8 for m in layers)
    assert not any(cpu_gemm.held(m).blocks or cpu_gemm.held(m).packed for m in layers)
