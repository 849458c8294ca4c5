"""`python -m kiln.benchmarks.attention`: a tiny shape's report (every case, cache dtype and
thread count timed, positive and finite), and bad options refused naming their flag."""
import json
import math

import pytest
import torch

from kiln.benchmarks import attention
from kiln.native import build


@pytest.mark.skipif(not build.available(), reason="no C compiler")  # as tests/native's
def test_a_tiny_run_reports_every_case_dtype_and_thread_count(capsys):
    threads = torch.get_num_threads()
    try:
        attention.main(["--heads", "4", "--kv-heads", "2", "--head-size", "32", "--decode",
                        "2x40", "3x17", "--prefill", "2x20x0", "--write-rows", "50",
                        "--rounds", "1", "--threads", "1", "2"])
    finally:
        torch.set_num_threads(threads)
    report = json.loads(capsys.readouterr().out)
    assert report["machine"]["threads"] == [1, 2] and report["rounds"] == 1
    assert report["shape"] == {"heads": 4, "kv_heads": 2, "head_size": 32, "block_size": 16,
                               "queries": "bfloat16"}
    dtypes = ["auto", "fp8_e4m3", "fp8_e5m2"]
    assert set(report["machine"]["decode_bf16_dot"]) == set(dtypes)
    labels = ["decode 2 x 40 keys", "decode 3 x 17 keys", "prefill 2 x 20 over 0",
              "write 50 rows"]
    rows = report["results"]
    assert [(r["label"], r["threads"]) for r in rows] == [(lb, t) for lb in labels for t in (1, 2)]
    assert [r["case"] for r in rows[::2]] == ["decode", "decode", "prefill", "write"]
    for row in rows:
        assert list(row["cache"]) == dtypes
        assert row["cache"]["auto"]["min_ratio_to_auto"] == 1.0
        for figures in row["cache"].values():
            assert set(figures) == {"min_ms", "median_ms", "min_ratio_to_auto",
                                    "median_ratio_to_auto"}
            assert all(math.isfinite(x) and x > 0 for x in figures.values()), figures


@pytest.mark.parametrize("argv, flag", [
    (["--rounds", "0"], "--rounds"),
    (["--threads", "1", "0"], "--threads"),
    (["--heads", "9", "--kv-heads", "2"], "--kv-heads"),
    (["--decode", "32"], "--decode"),
    (["--decode", "32xa"], "--decode"),
    (["--prefill", "2x512"], "--prefill"),
    (["--prefill", "0x512x0"], "--prefill"),
    (["--decode", "32x0"], "--decode"),
    (["--cache-dtypes", "fp8"], "--cache-dtypes"),
    (["--cache-dtypes", "int8"], "--cache-dtypes"),
])
def test_a_bad_option_is_refused_naming_its_flag(argv, flag, capsys):
    with pytest.raises(SystemExit) as exc:
        attention.parse_args(argv)
    assert exc.value.code == 2
    assert flag in capsys.readouterr().err
