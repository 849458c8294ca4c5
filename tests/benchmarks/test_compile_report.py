"""`kiln compile`: a cold run compiles and reports pieces/shapes/cache; a second process on the
same cache directory loads every artifact and compiles nothing."""
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from kiln.compilation.monitor import per_shape
from kiln.engine.arg_utils import EngineArgs
from kiln.entrypoints.cli.compile import format_report
from kiln.entrypoints.cli.main import build_parser
from kiln.native import gguf_matmul, int4_linear, int8_ops

NUM_LAYERS = 2  # the tiny_llama_dir fixture's checkpoint
SMALL = ["--kv-cache-memory", "0.01", "--max-model-len", "64", "--max-num-seqs", "8",
         "--max-num-batched-tokens", "32"]


def start_compile(model: Path, cache_dir: Path, *extra: str) -> subprocess.Popen:
    """`kiln compile --json` (mode 3) on `model`, started; its output goes to temporary files
    (nobody drains a pipe meanwhile), read by compile_report."""
    spec = json.dumps({"mode": 3, "cache_dir": str(cache_dir)})
    stdout, stderr = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
    proc = subprocess.Popen([sys.executable, "-m", "kiln.entrypoints.cli.main", "compile",
                             "--json", "--model", str(model), *SMALL, "-O", spec, *extra],
                            stdout=stdout, stderr=stderr, text=True)
    proc.outputs = (stdout, stderr)
    return proc


def _read_and_close(f) -> str:
    with f:
        f.seek(0)
        return f.read()


def compile_report(proc: subprocess.Popen) -> dict:
    """The report of a start_compile run, once it has ended."""
    returncode = proc.wait(timeout=600)
    stdout, stderr = map(_read_and_close, proc.outputs)
    assert returncode == 0, stderr[-3000:]
    lines = stdout.splitlines()
    assert len(lines) == 1, stdout  # stdout holds the report only; logs go to stderr
    return json.loads(lines[0])


def kiln_compile(model: Path, cache_dir: Path, *extra: str) -> dict:
    return compile_report(start_compile(model, cache_dir, *extra))


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("compile_cache")


@pytest.fixture(scope="module", autouse=True)
def cold_started(tiny_llama_dir, cache_dir):
    """The cold `kiln compile`, started with the module's first test: it compiles in its own
    process while the in-process tests above the cold ones run (the suite's machine has two
    cores). Stopped at the module's end if no test waited for it."""
    proc = start_compile(tiny_llama_dir, cache_dir)
    yield proc
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.fixture(scope="module")
def cold(cold_started) -> dict:
    return compile_report(cold_started)


def test_report_names_every_ir_op_implementation_and_an_override(tiny_llama_dir, capsys):
    from kiln import ir

    natives = {name: "native" if "native" in op.impls else "torch"
               for name, op in ir.REGISTRY.items()}
    args = build_parser().parse_args(["compile", "--json", "--model", str(tiny_llama_dir),
                                      *SMALL, "-O0", "--ir-op-priority", "rms_norm=torch"])
    assert args.func(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ir_ops"] == {**natives, "rms_norm": "torch"}


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_ir_ops_line_lists_the_models_ops_only(tiny_llama_dir, capsys, quantization):
    """A float model's report listed the int8, fp8 and GGUF ops and all_reduce at one rank
    (helper-90); the JSON keeps every op's choice."""
    flags = ["--quantization", quantization] if quantization else []
    args = build_parser().parse_args(["compile", "--json", "--model", str(tiny_llama_dir),
                                      *SMALL, "-O0", *flags])
    assert args.func(args) == 0
    report = json.loads(capsys.readouterr().out)
    (line,) = [x for x in format_report(report).splitlines() if x.startswith("ir ops")]
    assert "fp8" not in line and "gguf" not in line and "all_reduce" not in line
    assert "f32_scale" not in line and "gelu" not in line  # Gemma's / OLMo-2's ops
    assert "fused_moe" not in line  # the MoE families' op
    assert ("int8" in line) == (quantization == "int8") and "rms_norm " in line
    assert "gguf_linear" in report["ir_ops"]


@pytest.mark.parametrize("quantization", [None, "int8"])
def test_ir_ops_line_lists_fused_moe_for_a_moe_model(tiny_qwen3_moe_dir, capsys, quantization):
    flags = ["--quantization", quantization] if quantization else []
    args = build_parser().parse_args(["compile", "--json", "--model", str(tiny_qwen3_moe_dir),
                                      *SMALL, "-O0", *flags])
    assert args.func(args) == 0
    report = json.loads(capsys.readouterr().out)
    (line,) = [x for x in format_report(report).splitlines() if x.startswith("ir ops")]
    assert "fused_moe native" in line and "gelu" not in line
    # int8 experts run packed in panels on a CPU that reads them so, else as stored
    int8_op = "fused_moe_int8_panels" if int8_ops.panel_cpu() else "fused_moe_int8"
    provider = "native" if int8_ops.isa() else "torch"
    assert (f"{int8_op} {provider}" in line) == (quantization == "int8")


def test_mode0_text_report_in_process(tiny_llama_dir, capsys):
    args = build_parser().parse_args(["compile", "--model", str(tiny_llama_dir), *SMALL, "-O0"])
    assert args.func(args) == 0
    out = capsys.readouterr().out
    assert "mode       0 (NONE)" in out and "nothing compiled" in out
    assert "pieces" not in out and "load model" in out


def test_per_shape_groups_and_orders_shapes():
    events = [{"piece": 0, "shape": "size 8", "action": "compiled", "s": 1.0},
              {"piece": 0, "shape": "range", "action": "loaded", "s": 0.5},
              {"piece": 2, "shape": "size 8", "action": "reused", "s": 0.0},
              {"piece": 0, "shape": "size 1", "action": "compiled", "s": 2.0},
              {"piece": 2, "shape": "range", "action": "loaded", "s": 0.25}]
    rows = per_shape(events)
    assert [r["shape"] for r in rows] == ["range", "size 1", "size 8"]
    assert rows[0] == {"shape": "range", "compiled": 0, "loaded": 2, "reused": 0,
                       "compile_s": 0.0, "load_s": 0.75}
    assert (rows[2]["compiled"], rows[2]["reused"], rows[2]["compile_s"]) == (1, 1, 1.0)


@pytest.mark.slow  # two ranks each compile their pieces cold (about 2 minutes on 2 cores)
def test_tp2_int8_report_is_each_ranks_compile(tiny_llama_dir, tmp_path):
    """At -tp 2 the ranks compile in their own processes: the report counted this process's
    compiles, so it said '0 total, 0 compiled', no passes and no cache at all (helper-94)."""
    report = kiln_compile(tiny_llama_dir, tmp_path / "cc", "-tp", "2", "--quantization", "int8")
    n = NUM_LAYERS
    assert [r["rank"] for r in report["ranks"]] == [0, 1]
    for rank in report["ranks"]:
        assert rank["pieces"] == {"total": 2 * n + 1, "compiled": n + 1, "graphs": 1}
        assert rank["inductor"]["compiles"] >= 1 and list(rank["cache"]["dirs"].values()) == [
            "miss"]
    # The ranks' graphs are alike and share Inductor's cache: the rank compiling a piece first
    # runs the passes on it, the other finds it rewritten. Every layer's input and
    # post-attention norms' quant and its activation's are fused on some rank.
    runs = [r["matches"] for rank in report["ranks"] for r in rank["pass_runs"]]
    assert sum(m["FuseNormQuant"] for m in runs) >= 2 * n
    assert sum(m["FuseActQuant"] for m in runs) >= n
    assert report["pieces"] == report["ranks"][0]["pieces"]
    assert report["times"]["compile_s"] > 0
    text = format_report(report)
    assert f"pieces     {2 * n + 1} total, {n + 1} compiled" in text
    assert f"rank 1: {2 * n + 1} pieces, {n + 1} compiled" in text and "FuseNormQuant" in text


@pytest.mark.parametrize("arch, absent, present", [
    ("gemma", ("rms_norm", "fused_add_rms_norm", "silu_and_mul", "rms_norm_dynamic_int8_quant",
               "silu_and_mul_dynamic_int8_quant", "int8_scaled_mm_panels_silu_quant"),
     ("rms_norm_f32_scale", "gelu_tanh_and_mul", "dynamic_int8_quant")),
    ("olmo2", ("rms_norm", "fused_add_rms_norm", "fused_add_rms_norm_dynamic_int8_quant",
               "gelu_tanh_and_mul"),
     ("fused_add_rms_norm_f32_scale", "silu_and_mul", "silu_and_mul_dynamic_int8_quant")),
    ("gpt_neox", ("rms_norm", "fused_add_rms_norm", "silu_and_mul", "gelu_tanh_and_mul",
                  "rms_norm_f32_scale", "fused_add_rms_norm_dynamic_int8_quant"),
     ("layer_norm", "fused_add_layer_norm", "gelu", "rotary_embedding", "dynamic_int8_quant")),
    # Cohere: LayerNorms, but Llama's SiLU-gated MLP (and its int8 fusion) kept
    ("cohere", ("rms_norm", "fused_add_rms_norm", "gelu", "gelu_tanh_and_mul",
                "fused_add_rms_norm_dynamic_int8_quant"),
     ("layer_norm", "fused_add_layer_norm", "silu_and_mul", "silu_and_mul_dynamic_int8_quant",
      "rotary_embedding"))])
def test_ops_in_use_leave_out_the_llama_ops_a_family_replaces(arch, absent, present, request):
    """A Gemma report listed rms_norm, silu_and_mul and their int8 fusions, which its (1 + w)
    norms and GeGLU replace; OLMo-2's listed the Llama norms."""
    from kiln.benchmarks.compile import _ops_in_use

    model_dir = request.getfixturevalue(f"tiny_{arch}_dir")
    used = _ops_in_use(EngineArgs(model=str(model_dir), quantization="int8",
                                  max_model_len=64).create_kiln_config())
    assert not set(absent) & set(used) and set(present) <= set(used)


# The cold run's tests, last: the in-process tests above run while it compiles (cold_started).


def test_cold_run_reports_pieces_shapes_and_compiles(cold, cache_dir):
    n = NUM_LAYERS
    assert cold["compilation_mode"] == 3 and cold["num_layers"] == n
    runs = cold["pass_runs"]  # one per piece compiled cold, each pass's rewrites in it
    assert len(runs) == cold["inductor"]["compiles"]
    assert all(list(r["matches"]) == ["EliminateNoops", "FuseNormQuant", "FuseActQuant",
                                      "FuseMmActQuant", "FuseAddRmsNormLinear",
                                      "FuseSiluMulLinear", "LowerIrOps", "ReinplaceIrOps"]
               for r in runs)
    assert sum(r["matches"]["FuseSiluMulLinear"] for r in runs) >= 1
    assert sum(r["matches"]["LowerIrOps"] for r in runs) >= 1
    assert all(r["matches"]["ReinplaceIrOps"] >= 1 for r in runs)  # each piece's rotary or norm
    ops = dict(cold["ir_ops"])
    # the MoE families' int8 experts, as stored or packed (one opaque node, as fused_moe): the
    # native provider where the int8 kernels run (kiln/ir/moe_native.py)
    moe_int8 = {op: ops.pop(op) for op in ("fused_moe_int8", "fused_moe_int8_panels")}
    assert set(moe_int8.values()) == {"native" if int8_ops.isa() else "torch"}
    int8 = {op: ops.pop(op) for op in list(ops) if "int8" in op}  # the W8A8 ops: VNNI CPUs only
    fp8 = {op: ops.pop(op) for op in list(ops) if "fp8" in op}  # GPU kernels only
    assert fp8 == {"dynamic_fp8_quant": "torch", "fp8_scaled_mm": "torch"}
    assert ops == {"all_reduce": "torch", "fused_add_rms_norm": "native",
                   "gguf_embedding": "native" if gguf_matmul.kernel_available() else "torch",
                   "gguf_linear": "native" if gguf_matmul.kernel_available() else "torch",
                   # W4A16's canonical layout: csrc/ops_int4.cpp where built with AVX-512
                   "int4_weight_linear": "native" if int4_linear.kernel_available() else "torch",
                   "linear": "native", "rms_norm": "native", "rotary_embedding": "native",
                   "silu_and_mul": "native", "unified_attention": "native",
                   # Gemma / OLMo-2's ops: the torch reference only
                   "rms_norm_f32_scale": "torch", "fused_add_rms_norm_f32_scale": "torch",
                   "gelu_tanh_and_mul": "torch",
                   # the LayerNorm families' (StarCoder2, GPT-NeoX, Phi, Cohere)
                   "layer_norm": "native", "fused_add_layer_norm": "native", "gelu": "native",
                   "lora_add": "native",  # the by-slot provider (kiln/ir/lora.py)
                   # the MoE families' experts: one opaque node, on the dense kernels
                   "fused_moe": "native"}
    # quant, two GEMMs, the GEMM + SiLU + quant, three norm or activation + quant
    assert len(int8) == 7 and set(int8.values()) == {"native" if int8_ops.isa() else "torch"}
    assert cold["pieces"] == {"total": 2 * n + 1, "compiled": n + 1, "graphs": 1}
    assert cold["shapes"] == {"range": [1, 32], "compile_sizes": []}
    (row,) = cold["per_shape"]
    assert row["shape"] == "range" and row["loaded"] == 0 and row["compiled"] >= 1
    assert row["compiled"] + row["reused"] == n + 1  # every compiled piece got the range shape
    ind = cold["inductor"]
    assert 1 <= ind["compiles"] <= n + 1 and ind["artifacts_saved"] == ind["compiles"]
    assert ind["artifacts_loaded"] == 0
    ((path, state),) = cold["cache"]["dirs"].items()
    assert state == "miss" and Path(path).is_relative_to(cache_dir)
    assert cold["cache"]["misses"] >= 1
    (key_dir,) = cold["cache"]["key_dirs"]
    assert Path(cold["cache"]["inductor_cache_dir"]).is_relative_to(key_dir)
    t = cold["times"]
    assert t["compile_s"] > 0 and t["artifact_load_s"] == 0
    assert t["total_s"] >= t["warmup_s"] >= t["compile_s"]


def test_second_process_same_cache_compiles_nothing(cold, tiny_llama_dir, cache_dir):
    warm = kiln_compile(tiny_llama_dir, cache_dir)
    assert warm["pieces"] == cold["pieces"]
    assert warm["inductor"]["compiles"] == 0 and warm["counters"]["num_backend_compilations"] == 0
    assert warm["inductor"]["artifacts_loaded"] == cold["inductor"]["artifacts_saved"]
    assert list(warm["cache"]["dirs"].values()) == ["hit"] and warm["cache"]["misses"] == 0
    assert warm["cache"]["key_dirs"] == cold["cache"]["key_dirs"]
    (row,) = warm["per_shape"]
    assert row["compiled"] == 0 and row["loaded"] == cold["inductor"]["artifacts_saved"]
    assert warm["times"]["compile_s"] == 0 and warm["times"]["artifact_load_s"] > 0


def test_a_speculative_draft_is_reported_apart_from_the_target(cold, tiny_llama_dir, cache_dir,
                                                               tmp_path, capsys):
    """A draft model compiles in the target's process: its pieces, compiles and cache were added
    to the target's. Now each section counts its own: the target (on the cold run's cache)
    loads its pieces and compiles nothing, the 1-layer draft compiles its 3 pieces cold."""
    from checkpoints import make_tiny_checkpoint

    draft_dir = make_tiny_checkpoint(tmp_path / "draft", "llama", tie=False, seed=1,
                                     num_hidden_layers=1, hidden_size=32,
                                     num_attention_heads=2, num_key_value_heads=1)
    spec = {"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": 2}
    args = build_parser().parse_args([
        "compile", "--json", "--model", str(tiny_llama_dir), *SMALL, "-O",
        json.dumps({"mode": 3, "cache_dir": str(cache_dir)}),
        "--speculative-config", json.dumps(spec)])
    assert args.func(args) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["pieces"] == cold["pieces"]  # the target's alone
    assert report["inductor"]["compiles"] == 0 and report["counters"]["num_dynamo_traces"] == 0
    assert report["inductor"]["artifacts_loaded"] == cold["inductor"]["artifacts_saved"]
    assert list(report["cache"]["dirs"].values()) == ["hit"] and report["pass_runs"] == []
    draft = report["draft"]
    assert (draft["model"], draft["method"], draft["num_layers"]) == (str(draft_dir),
                                                                       "draft_model", 1)
    assert draft["compilation_mode"] == 3 and draft["counters"]["num_dynamo_traces"] == 1
    assert draft["pieces"] == {"total": 3, "compiled": 2, "graphs": 1}
    ind = draft["inductor"]
    assert 1 <= ind["compiles"] == ind["artifacts_saved"] == len(draft["pass_runs"]) <= 2
    assert ind["artifacts_loaded"] == 0 and list(draft["cache"]["dirs"].values()) == ["miss"]
    assert sum(row["compiled"] + row["reused"] for row in draft["per_shape"]) == 2
    assert draft["times"]["compile_s"] > 0 and report["times"]["compile_s"] == 0
    text = format_report(report)
    assert f"pieces     {2 * NUM_LAYERS + 1} total, {NUM_LAYERS + 1} compiled" in text
    assert f"draft      {draft_dir} (draft_model, LlamaForCausalLM, 1 layers)" in text
    assert "  pieces     3 total, 2 compiled" in text


def test_warm_runs_in_one_process_list_the_cache_they_loaded(cold, tiny_llama_dir, cache_dir,
                                                              capsys):
    """A second `kiln compile` in this process on the same cache opens the directory the first
    opened: each lists it (the second listed none: only directories new to the process were)."""
    args = build_parser().parse_args([
        "compile", "--json", "--model", str(tiny_llama_dir), *SMALL, "-O",
        json.dumps({"mode": 3, "cache_dir": str(cache_dir)})])
    for _ in range(2):
        assert args.func(args) == 0
        warm = json.loads(capsys.readouterr().out)
        assert warm["cache"]["dirs"] == {p: "hit" for p in cold["cache"]["dirs"]}
        assert warm["cache"]["key_dirs"] == cold["cache"]["key_dirs"]
        assert warm["inductor"]["compiles"] == 0 and warm["cache"]["misses"] == 0


def test_text_report_names_pieces_cache_and_times(cold):
    text = format_report(cold)
    assert f"pieces     {2 * NUM_LAYERS + 1} total, {NUM_LAYERS + 1} compiled" in text
    assert "range [1, 32]; compile sizes: none" in text
    assert f"{next(iter(cold['cache']['dirs']))} [miss]" in text
    assert f"inductor   {cold['inductor']['compiles']} compiles, 0 artifacts loaded" in text
    assert "total" in text and "Dynamo trace" in text
    assert "ir ops     fused_add_rms_norm native, linear native, rms_norm native" in text
    assert "passes     EliminateNoops " in text and "FuseAddRmsNormLinear " in text
    assert "cold piece compiles" in text


def test_mode1_text_report_does_not_claim_pieces(cold):
    """Modes 1 and 2 are torch.compile's own path: no split, no Kiln cache, no trace split."""
    text = format_report({**cold, "compilation_mode": 1,
                          "compilation_mode_name": "STOCK_TORCH_COMPILE"})
    assert "plain torch.compile" in text
    assert "pieces     " not in text and "Dynamo trace" not in text and "cache      " not in text
