"""W8A8 int8 at 2 tensor-parallel ranks (mp executor), a compressed-tensors checkpoint and online
`quantization="int8"`: each rank loads its rows of the int8 weights and their scales (a
row-parallel layer its columns, with every output's scale) and a row-parallel layer quantizes its
own part of each token, as vLLM's do. Per-token scales then differ from TP=1's, so prompt logprobs
are compared within a bound (measured 0.030 and 0.027 on this model; a scale on the wrong rows is
off by whole units); compiled (mode 3, the fusion passes on each rank's graph) equals eager.
Online int8 rotates its residual stream at -tp 2 as at -tp 1 (quantization_rotation auto).
"""
import pytest

from kiln import SamplingParams

from checkpoints import make_tiny_checkpoint, random_prompts, with_random_norms_and_biases
from parallel_helpers import make_llm
from w8a8_checkpoint import write_w8a8_checkpoint

LENGTHS = [1, 9, 40, 90]  # 90 > the 64-token budget: chunked prefill
TP2_FROM_TP1 = 0.06


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    src = make_tiny_checkpoint(tmp_path_factory.mktemp("float"), "llama", tie=False,
                               num_hidden_layers=2)
    return src, write_w8a8_checkpoint(src, tmp_path_factory.mktemp("w8a8"))


def _run(model_dir, tmp_path, tp: int, mode: int = 0, probe=None, **kw):
    """(prompt logprobs of each prompt's tokens after the first, greedy tokens); `probe`: a
    function collective_rpc runs on each rank first, its answers kept in _run.probed."""
    llm = make_llm(model_dir, tensor_parallel_size=tp, max_num_batched_tokens=64,
                   compilation_config={"mode": mode, "cache_dir": str(tmp_path / f"cc{mode}")},
                   **kw)
    prompts = [{"prompt_token_ids": p} for p in random_prompts(len(LENGTHS), LENGTHS, seed=5)]
    try:
        _run.probed = None if probe is None else llm.collective_rpc(probe)
        scored = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1,
                                                      prompt_logprobs=0), use_tqdm=False)
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8,
                                                    ignore_eos=True), use_tqdm=False)
    finally:
        llm.shutdown()
    logprobs = [[next(iter(step.values())).logprob for step in o.prompt_logprobs[1:]]
                for o in scored]
    return logprobs, [o.outputs[0].token_ids for o in outs]


def _max_diff(a, b):
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


def test_a_w8a8_checkpoint_at_tp2_scores_as_tp1_and_compiles_as_it_runs_eagerly(dirs, tmp_path):
    _, w8a8 = dirs
    tp1, _ = _run(w8a8, tmp_path, 1)
    tp2, tokens = _run(w8a8, tmp_path, 2)
    assert _max_diff(tp2, tp1) < TP2_FROM_TP1
    tp2_compiled, compiled_tokens = _run(w8a8, tmp_path, 2, mode=3)
    assert compiled_tokens == tokens
    assert _max_diff(tp2_compiled, tp2) < 1e-4


def rank_rotated(worker) -> bool:
    """collective_rpc's function: whether this rank's model carries its stream rotated."""
    return worker.model_runner.model.model.residual_rotation is not None


@pytest.mark.parametrize("rotation", ["auto", "none"])
def test_online_int8_at_tp2_scores_as_tp1(tmp_path, rotation):
    """auto rotates at -tp 2 too: each rank rotates its shards, every one of which holds the
    hidden dimension whole and whole heads. A Llama with hidden 192 (Q: H_64 (x) a random
    3 x 3), norms and biases drawn at random, other per-token scales than -tp 1's: measured
    0.11 rotated, 0.14 not; the two ranks rotating by different Qs, 4.3."""
    src = with_random_norms_and_biases(make_tiny_checkpoint(
        tmp_path / "m", "llama", tie=False, hidden_size=192, num_attention_heads=6,
        attention_bias=True, mlp_bias=True))
    tp1, _ = _run(src, tmp_path, 1, quantization="int8", quantization_rotation=rotation)
    tp2, _ = _run(src, tmp_path, 2, quantization="int8", quantization_rotation=rotation,
                  probe=rank_rotated)
    assert _run.probed == [rotation == "auto"] * 2
    assert _max_diff(tp2, tp1) < 0.2


def test_a_scheme_kiln_does_not_run_is_one_line_at_tp2_as_at_tp1(dirs, tmp_path):
    """Each rank refuses the scheme as it loads: that came back as WorkerFailedError holding the
    rank's whole traceback, so `kiln generate -tp 2` printed 30 lines where -tp 1 prints the
    refusal (a ValueError, exit 2). The rank's ValueError is raised again as itself."""
    import json
    import shutil

    from kiln.model.layers.quantization.compressed_tensors import UnsupportedQuantization

    bad = shutil.copytree(dirs[1], tmp_path / "bad")
    config = json.loads((bad / "config.json").read_text())
    config["quantization_config"]["config_groups"]["group_0"]["weights"]["strategy"] = "tensor"
    (bad / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedQuantization) as refused:
        make_llm(bad, tensor_parallel_size=2)
    assert str(refused.value).startswith("quantization_config.config_groups.group_0.weights."
                                         "strategy='tensor' is not supported")
    assert "Traceback" not in str(refused.value)


def test_only_a_ranks_start_up_user_error_or_compile_error_is_raised_as_itself():
    from kiln.compilation.piecewise import PieceCompileError
    from kiln.core.core_messages import failure_report
    from kiln.errors import ConfigError
    from kiln.executor.rank_errors import startup_error

    def report(e):
        try:
            raise e
        except BaseException as raised:  # noqa: BLE001 - a traceback, as a rank's
            return failure_report(raised)

    assert type(startup_error(report(ConfigError("v")), 0, "start-up")) is ConfigError
    assert startup_error(report(ValueError("a bug, not a refusal")), 0, "start-up") is None
    assert type(startup_error(report(FileNotFoundError("f")), 1, "start-up")) is \
        FileNotFoundError
    piece = startup_error(report(PieceCompileError("compiling piece 0 failed")), 0,
                          "compile_or_warm_up_model")
    assert type(piece) is PieceCompileError and str(piece) == "compiling piece 0 failed"
    assert startup_error(report(TypeError("a bug")), 0, "start-up") is None
    assert startup_error(report(RuntimeError("a bug")), 0, "start-up") is None
    assert startup_error(report(ValueError("in a step")), 0, "execute_model") is None
