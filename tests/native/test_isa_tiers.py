"""The CPU kernels as they are built for CPUs below this one, run here against the references.

The library builds with -march=native, so the suite only ever runs the paths of the machine it
is on: on one with AMX, never the int8 GEMM on VNNI register tiles alone (AMD EPYC Zen 4, Intel
Ice Lake / Cascade Lake) nor any kernel's portable path (no AVX-512: Zen 2/3, Alder Lake).
Each tier builds with the features such a CPU lacks turned off (-mno-...), in the machine's
kernel cache (a key of its own, built once and reused like the native build), and a child
process (a process loads one library) checks its layer ops, int8 ops and attention against
the references and reports what the build chose (tests/native/_tier_child.py).
No tier of AVX512-BF16 without AMX (AMD Zen 4), a third build each time the sources change: its
MoE route is covered in parts. rows_gemm.c's AVX512-BF16 dot kernel runs at every shape on any
AVX512-BF16 CPU, AMX or not (kiln::rows_gemm_native, test_rows_gemm.py); choose_route's limit
for it is a pure function (test_moe_native.py); the experts' rows route in bfloat16, the same
code for either kernel, runs in the tier below (widened). On a Zen 4 the native suite runs it whole.
"""
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.native import build

pytestmark = pytest.mark.skipif(build.compiler() is None, reason="no C++ compiler")

HERE = Path(__file__).parent
AMX = ["-mno-amx-tile", "-mno-amx-int8", "-mno-amx-bf16"]
# tier -> (extra compile flags, the /proc/cpuinfo flags a CPU of the tier lacks)
TIERS = {
    "avx512_vnni_no_amx": ([*AMX, "-mno-avx512bf16", "-mno-avx512fp16"],
                           {"amx_tile", "amx_int8", "amx_bf16", "avx512_bf16", "avx512_fp16"}),
    "no_avx512": ([*AMX, "-mno-avx512f"], {"amx_tile", "amx_int8", "amx_bf16", "avx512f",
                                           "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16"}),
}
INT8_OPS = ("dynamic_int8_quant", "int8_scaled_mm", "int8_scaled_mm_panels",
            "int8_scaled_mm_panels_silu_quant", "rms_norm_dynamic_int8_quant",
            "fused_add_rms_norm_dynamic_int8_quant", "silu_and_mul_dynamic_int8_quant")


def _run_tier(flags: list[str]) -> dict:
    env = {**os.environ, "KILN_NATIVE_CFLAGS": " ".join(flags), "PYTHONPATH": os.pathsep.join(
        [str(HERE), *filter(None, [os.environ.get("PYTHONPATH")])])}
    proc = subprocess.run([sys.executable, str(HERE / "_tier_child.py")],
                          capture_output=True, text=True, env=env, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("tier", sorted(TIERS))
def test_a_lower_cpus_kernels_match_the_references(tier):
    if platform.machine() not in ("x86_64", "AMD64"):
        return  # the tiers are x86's (and so are their -mno- flags); nothing to run elsewhere
    flags, lacks = TIERS[tier]
    report = _run_tier(flags)
    assert report["failures"] == [], report["failures"]
    assert "/kernels/" in report["library"]  # its own build, not this process's library
    has = build.cpu_flags() - lacks
    vnni = {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= has
    # int8: VNNI register tiles alone (oneDNN from 64 rows) or, without them, the references
    assert report["int8_isa"] == ("avx512_vnni" if vnni else None)
    assert report["amx_min_rows"] == 0 and not report["prefill_amx"] and not report["moe_tiles"]
    if vnni:
        assert report["onednn_min_rows"] == 64
    for op in INT8_OPS:
        assert report["chosen"][op] == ("native" if vnni else "torch"), op
    # bfloat16 attention: AVX512-BF16 dot products and prefill tiles only where the CPU has them
    bf16 = {"avx512f", "avx512bw", "avx512_bf16"} <= has
    assert report["bf16_dot"] == bf16
    assert report["prefill_simd"] == ["avx512f" in has, bf16]
    # the MoE experts' rows kernel (csrc/rows_gemm.c): AVX-512 FMA, bfloat16 on AVX512-BF16 dot
    # products where the CPU has them; none without AVX-512 (the GEMV kernel and aten)
    avx512 = {"avx512f", "avx512bw"} <= has
    assert report["rows_isa"] == ([1, 2 if bf16 else 1] if avx512 else [0, 0])
    # the GGUF blocks kernel needs AVX-512; without it the reference runs
    assert report["gguf_kernel"] == ({"avx512f", "avx512bw"} <= has)
    assert report["chosen"]["gguf_linear"] == ("native" if report["gguf_kernel"] else "torch")
