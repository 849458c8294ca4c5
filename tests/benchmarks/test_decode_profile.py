"""The decode profile's pure parts: a step's clocks summarized, and the engines' ratios per
thread count."""
import time

from kiln.benchmarks import decode_profile as dp


def test_timed_returns_the_result_and_each_clock():
    out, secs = dp.timed(lambda: (time.sleep(0.01), 7)[1])
    assert out == 7
    assert secs["wall"] >= 0.01 and 0 <= secs["thread"] < secs["wall"]
    assert secs["process"] >= secs["thread"] - 1e-3


def test_timing_summary_takes_min_and_median_and_busy_cores():
    runs = [{"wall": 0.010, "thread": 0.009, "process": 0.020},
            {"wall": 0.020, "thread": 0.012, "process": 0.030},
            {"wall": 0.012, "thread": 0.010, "process": 0.018}]
    got = dp.timing_summary(runs)
    assert got["wall_min_ms"] == 10.0 and got["wall_median_ms"] == 12.0
    assert got["thread_min_ms"] == 9.0 and got["process_median_ms"] == 20.0
    assert got["busy_cores"] == 1.5  # median of 2.0, 1.5 and 1.5


def test_speedups_divide_the_unquantized_step_by_the_quantized_one_per_thread_count():
    def clocks(wall, thread, process):
        return {"wall_min_ms": wall, "thread_min_ms": thread, "process_min_ms": process}

    report = {"int8": {"decode": {"1": clocks(50.0, 50.0, 50.0), "2": clocks(40.0, 25.0, 80.0)}},
              "unquantized": {"decode": {"1": clocks(70.0, 70.0, 70.0),
                                         "2": clocks(50.0, 36.0, 90.0)}}}
    got = dp.speedups(report, "int8", [1, 2], "decode")
    assert got == {"1": {"wall": 1.4, "thread": 1.4, "process": 1.4},
                   "2": {"wall": 1.25, "thread": 1.44, "process": 1.125}}
