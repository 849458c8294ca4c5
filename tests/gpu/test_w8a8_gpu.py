"""W8A8 on a GPU. fp8: the IR's `cuda` provider (torch._scaled_mm, row-wise scales) is chosen
for a bfloat16 model and matches the reference; online `quantization="fp8"` and `"ptpc_fp8"`
engines give the same greedy tokens eagerly and compiled (mode 3, with CUDA graphs) up to
near-ties. int8: the reference's GEMM (torch._int_mm, operands padded to a shape cuBLASLt takes)
is exact at decode's few rows, and online `quantization="int8"` runs eager and compiled alike."""
import pytest
import torch

from kiln import ir
from kiln.ir import quant_fp8

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.usefixtures("inprocess_core")]

needs_sm90 = pytest.mark.skipif(
    torch.cuda.is_available() and torch.cuda.get_device_capability() < (9, 0),
    reason="needs CUDA compute capability 9.0 (row-wise fp8 scales)")


@needs_sm90
def test_the_cuda_gemm_is_chosen_and_matches_the_reference():
    assert ir.resolve({}, "cuda", torch.bfloat16).provider("fp8_scaled_mm") == "cuda"
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(33, 128, device="cuda", generator=g, dtype=torch.bfloat16)
    w = torch.randn(256, 128, device="cuda", generator=g)
    q, scale = quant_fp8.dynamic_fp8_quant.reference(x)
    w_q, w_scale = quant_fp8.dynamic_fp8_quant.reference(w)
    bias = torch.randn(256, device="cuda", generator=g, dtype=torch.bfloat16)
    args = (q, scale, w_q, w_scale.reshape(-1), bias, torch.bfloat16)
    assert quant_fp8.scaled_mm_supported(*args)
    got = quant_fp8.fp8_scaled_mm.impls["cuda"].fn(*args)
    ref = quant_fp8.fp8_scaled_mm.reference(*args)
    assert torch.allclose(got.float(), ref.float(), rtol=2e-2, atol=2e-2 * ref.abs().max())


# Eager and compiled bfloat16 runs round differently (likely: Inductor fuses the per-token
# quant into the norm before it and need not round the norm's output to bfloat16 first, so an
# activation can land on the next e4m3 value; not traced): greedy tokens agree until a near-tie
# flips, and logprobs of agreeing tokens stay close. A random tiny model's logits are nearly
# flat, so ties are common.
LOGPROB_TOL = 0.1


def assert_greedy_agrees(eager, compiled, tol=LOGPROB_TOL):
    """Tokens equal until the first difference, which must be a near-tie in the eager run: the
    compiled run's token within `tol` of the eager top token's logprob."""
    for i, (a, b) in enumerate(zip(eager.token_ids, compiled.token_ids)):
        top = eager.logprobs[i]
        if a != b:
            gap = top[a].logprob - top[b].logprob if b in top else float("inf")
            assert gap <= tol, (i, a, b, gap)
            return
        diff = abs(top[a].logprob - compiled.logprobs[i][a].logprob)
        assert diff <= tol, (i, diff)


def test_int8_gemm_is_exact_at_every_row_count():
    from kiln.ir import quant

    g = torch.Generator(device="cuda").manual_seed(0)
    for m, k, n in ((1, 64, 96), (16, 64, 96), (17, 64, 96), (40, 60, 70), (3, 576, 960)):
        q = torch.randint(-128, 128, (m, k), dtype=torch.int8, device="cuda", generator=g)
        w = torch.randint(-128, 128, (n, k), dtype=torch.int8, device="cuda", generator=g)
        exact = (q.cpu().long() @ w.cpu().long().t()).int()
        assert torch.equal(quant._int_mm_padded(q, w).cpu(), exact), (m, k, n)


@pytest.mark.parametrize("quantization", ["fp8", "ptpc_fp8", "int8"])
def test_online_quantization_greedy_is_the_same_eager_and_compiled(tiny_llama_dir, tmp_path,
                                                                   quantization):
    from kiln import LLM, SamplingParams

    if quantization != "int8" and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("needs CUDA compute capability 9.0 (row-wise fp8 scales)")

    outs = []
    for mode in (0, 3):
        llm = LLM(model=str(tiny_llama_dir), dtype="bfloat16", quantization=quantization,
                  max_model_len=128, max_num_batched_tokens=64, num_gpu_blocks_override=256,
                  compilation_config={"mode": mode, "cache_dir": str(tmp_path / "cc")})
        params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=5)
        res = llm.generate([{"prompt_token_ids": p} for p in ([5, 6, 7], list(range(9, 40)))],
                           params, use_tqdm=False)
        outs.append([r.outputs[0] for r in res])
        llm.shutdown()
    for eager, compiled in zip(*outs):
        assert_greedy_agrees(eager, compiled)
