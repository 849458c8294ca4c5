"""The GEMM rates benchmark times the calls the engines make, with results that are right."""
import torch

from kiln.benchmarks import gemm_rates
from kiln.ir import int8_panels, quant
from kiln.native import int8_ops


def test_the_timed_calls_compute_the_linear():
    if int8_ops.isa() is None:  # no kernels: the benchmark refuses to run
        return
    calls = gemm_rates.gemm_calls(5, 70, 64)
    g = torch.Generator().manual_seed(0)  # the inputs gemm_calls draws
    x = torch.randn(5, 64, generator=g).to(torch.bfloat16)
    w = (torch.randn(70, 64, generator=g) * 0.05).to(torch.bfloat16)
    assert torch.allclose(calls["bf16"]().float(), torch.nn.functional.linear(x, w).float(),
                          rtol=2e-2, atol=2e-2)
    q, scale = quant.dynamic_int8_quant.reference(x)
    w_q, w_scale = quant.dynamic_int8_quant.reference(w)
    want = int8_panels.int8_scaled_mm_panels.reference(
        q, scale, int8_panels.pack_int8_panels(w_q), w_scale.reshape(-1), None, torch.bfloat16)
    assert torch.equal(calls["int8"](), want)


def test_report_names_every_projection():
    if int8_ops.isa() is None:
        return
    report = gemm_rates.main(["--rows", "8", "--rounds", "1"])
    assert set(gemm_rates.SHAPES) <= set(report)
    assert all(report[p]["int8_gmacs"] > 0 and report[p]["bf16_gmacs"] > 0
               for p in gemm_rates.SHAPES)
    assert report["gate_up"]["int8_silu_quant_ms"] > 0
    assert set(report["add_rms_norm"]) == {"bf16_ms", "int8_quant_ms"}


def test_the_timed_norm_calls_compute_the_norm_and_its_quant():
    if int8_ops.isa() is None:
        return
    calls = gemm_rates.norm_calls(3, 40)
    normed, _ = calls["bf16"]()
    q, scale, _ = calls["int8"]()
    want_q, want_scale = quant.dynamic_int8_quant.reference(normed)
    assert torch.equal(q, want_q) and torch.equal(scale, want_scale)


def test_the_callers_thread_count_is_restored():
    """main() times one thread; a compile cache key read later in the process includes the
    count, so leaving 1 made a warm start in another process compile everything again."""
    if int8_ops.isa() is None:
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        gemm_rates.main(["--rows", "2", "--rounds", "1"])
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(threads)
