"""Compiled engines equal HF transformers token for token (float32), in every compile mode.

Mixed-length batch with chunked prefill; mode 3 also checks the piece counters and that serving
neither compiles nor enters Dynamo.
"""
import os

import pytest
import torch
import torch._dynamo  # sets TORCHINDUCTOR_CACHE_DIR itself, at import: before the snapshots

from kiln import LLM, SamplingParams, ir
from kiln.compilation.counters import compilation_counter
from kiln.compilation.passes import lower_ir
from kiln.native import attention_op

from checkpoints import hf_greedy, make_tiny_checkpoint, random_prompts

# Compile and kernel counters, scheduler state: this process must run the core.
pytestmark = pytest.mark.usefixtures("inprocess_core")

LENGTHS = [1, 9, 40, 150]  # 150 > the 64-token budget: chunked prefill
NEW_TOKENS = 16
NUM_LAYERS = 4  # deep enough for identical middle pieces (layers 1-3) to share a compile


@pytest.fixture(scope="module")
def llama4_dir(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("llama4"), "llama", tie=False,
                                num_hidden_layers=NUM_LAYERS)


@pytest.fixture(scope="module")
def oracle(llama4_dir):
    prompts = random_prompts(len(LENGTHS), LENGTHS, seed=11)
    return prompts, hf_greedy(llama4_dir, prompts, NEW_TOKENS)


def _generate(llm, prompts):
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    before = attention_op.call_counts() if attention_op.available() else None
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    if before is not None:  # decode steps reach the C kernel from C++
        assert attention_op.call_counts()["kernel"] > before["kernel"]
    return [o.outputs[0].token_ids for o in outs]


TORCH_FIRST = {name: ["torch"] for name in ir.REGISTRY}


def _llm(model_dir, tmp_path, compilation_config, **kw):
    return LLM(model=str(model_dir), dtype="float32", max_num_batched_tokens=64, max_num_seqs=8,
               kv_cache_memory=0.05,
               compilation_config={**compilation_config, "cache_dir": str(tmp_path / "cc")}, **kw)


# Mode 3 (eager backend): the cold engine of test_mode3_eager_cold_and_warm_start_match_hf.
@pytest.mark.parametrize("config", [{"mode": 0}, {"mode": 1}, {"mode": 2}],
                         ids=["mode0", "mode1", "mode2"])
def test_modes_match_hf(llama4_dir, tmp_path, oracle, config):
    prompts, expected = oracle
    llm = _llm(llama4_dir, tmp_path, config)
    assert _generate(llm, prompts) == expected


def test_mode3_inductor_matches_hf_serves_without_compiling_and_warm_starts(llama4_dir, tmp_path,
                                                                           oracle):
    """Cold: piece counts, no compile or Dynamo entry while serving, the lowered providers and
    fused ops in Inductor's code; then a second engine on the same cache loads the saved graph."""
    prompts, expected = oracle
    before, environ = compilation_counter.clone(), dict(os.environ)
    lower_ir.reset_record()
    llm = _llm(llama4_dir, tmp_path, {"mode": 3, "backend": "inductor"})
    c = compilation_counter
    assert c.num_piecewise_graphs_seen - before.num_piecewise_graphs_seen == 2 * NUM_LAYERS + 1
    assert (c.num_piecewise_capturable_graphs_seen
            - before.num_piecewise_capturable_graphs_seen) == NUM_LAYERS + 1
    # One shape (the range): identical middle pieces share a compile, so fewer than N+1.
    assert 0 < c.num_inductor_compiles - before.num_inductor_compiles < NUM_LAYERS + 1
    dynamo_frames = sum(torch._dynamo.utils.counters["frames"].values())
    with compilation_counter.expect(num_inductor_compiles=0, num_backend_compilations=0,
                                    num_dynamo_traces=0, num_graphs_seen=0):
        got = _generate(llm, prompts)
    assert sum(torch._dynamo.utils.counters["frames"].values()) == dynamo_frames
    assert got == expected
    assert dict(os.environ) == environ  # Inductor's cache dir was set around compiles only
    # The compiled graphs took every IR op's eager implementation (a cold cache: the passes ran).
    eager = ir.applied()
    for op, providers in lower_ir.lowered_providers().items():
        assert providers == {eager[op]}, (op, providers, eager)
    if attention_op.available():  # on CPU the fusion passes applied
        code = [p.read_text() for p in (tmp_path / "cc").rglob("*.py")]
        for op in ("add_rms_norm_linear", "silu_mul_linear"):
            assert any(f"torch.ops.kiln.{op}.default(" in c for c in code), op
        # reinplace_ir_ops (on by default): rotary rotates q/k inside the QKV output's buffer,
        # the final norm writes over its inputs; their functional forms are gone
        for op in ("rotary_embedding_native", "fused_add_rms_norm_native"):
            assert any(f"torch.ops.kiln.{op}_.default(" in c for c in code), op
            assert not any(f"torch.ops.kiln.{op}.default(" in c for c in code), op
    del llm
    _assert_warm_start_matches_hf(llama4_dir, tmp_path, {"mode": 3, "backend": "inductor"},
                                  prompts, expected)


def _assert_warm_start_matches_hf(model_dir, tmp_path, config, prompts, expected):
    """A second engine on the cold one's compile cache runs the saved graph: no Dynamo trace."""
    environ = dict(os.environ)
    with compilation_counter.expect(num_dynamo_traces=0, num_graphs_seen=0,
                                    num_saved_graph_loads=1, num_inductor_compiles=0):
        warm = _llm(model_dir, tmp_path, config)
    assert _generate(warm, prompts) == expected
    assert dict(os.environ) == environ  # no engine writes the process's environment


def test_mode3_eager_cold_and_warm_start_match_hf(llama4_dir, tmp_path, oracle):
    """Mode 3 with the eager backend (traced and split, no Inductor), cold and then warm."""
    prompts, expected = oracle
    environ = dict(os.environ)
    cold = _llm(llama4_dir, tmp_path, {"mode": 3, "backend": "eager"})
    assert _generate(cold, prompts) == expected
    assert dict(os.environ) == environ
    del cold
    _assert_warm_start_matches_hf(llama4_dir, tmp_path, {"mode": 3, "backend": "eager"},
                                  prompts, expected)


@pytest.mark.parametrize("config", [{"mode": 0}, {"mode": 2}, {"mode": 3, "backend": "inductor"}],
                         ids=["mode0", "mode2", "mode3"])
def test_torch_first_for_every_ir_op_matches_hf(llama4_dir, tmp_path, oracle, config):
    """The plain-torch references alone (inlined into Inductor's code in mode 3) give HF's
    tokens; the override is what eager forwards and compiled graphs both took."""
    prompts, expected = oracle
    lower_ir.reset_record()
    llm = _llm(llama4_dir, tmp_path, config, ir_op_priority=TORCH_FIRST)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert set(ir.applied().values()) == {"torch"}
    lowered = lower_ir.lowered_providers()
    if config["mode"] == 3:
        assert set(lowered) >= {"linear", "rms_norm", "fused_add_rms_norm", "silu_and_mul",
                                "rotary_embedding"}
        assert all(p == {"torch"} for p in lowered.values()), lowered
        code = "".join(p.read_text() for p in (tmp_path / "cc").rglob("*.py"))
        for native in ("_native.default(", "add_rms_norm_linear", "silu_mul_linear"):
            assert native not in code, native  # no kernel of the native provider was called
    else:
        assert not lowered
