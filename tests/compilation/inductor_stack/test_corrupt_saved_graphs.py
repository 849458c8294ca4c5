"""A saved graph that is corrupt, edited or stale, or a warm start with a debug dump: Kiln warns
and traces again, and serves the cold compile's outputs."""
import json
import shutil

import torch

from .toy_compiles import _run, _warm_model


def test_corrupt_saved_graph_warns_and_traces(cold, tmp_path, kiln_logs):
    cache = tmp_path / "cache"
    shutil.copytree(cold["root"] / "cache", cache)
    saved = next(cache.glob("*/rank_0/ToyModel/saved_graph.pkl"))
    saved.write_bytes(saved.read_bytes()[:50])
    model = _warm_model(cache, dict(num_dynamo_traces=1, num_saved_graph_loads=0,
                                    num_inductor_compiles=0, num_compiled_artifacts_loaded=9))
    assert "saved graph" in kiln_logs.text and "failed to load" in kiln_logs.text
    for n in (8, 3):
        assert torch.equal(_run(model, n), _run(cold["model"], n))


def test_warm_start_with_debug_dump_traces_and_dumps(cold, tmp_path):
    cache, dump = tmp_path / "cache", tmp_path / "dump"
    shutil.copytree(cold["root"] / "cache", cache)
    _warm_model(cache, dict(num_dynamo_traces=1, num_saved_graph_loads=0, num_inductor_compiles=0,
                            num_compiled_artifacts_loaded=9), debug_dump_path=str(dump))
    out = dump / "rank_0" / "ToyModel"
    assert (out / "split_graph.py").exists() and len(list(out.glob("piece_*.py"))) == 5
    assert list(out.glob("output_code_*.py"))  # the loaded artifacts' code


def test_edited_saved_graph_plan_warns_and_traces(cold, tmp_path, kiln_logs):
    cache = tmp_path / "cache"
    shutil.copytree(cold["root"] / "cache", cache)
    plan = next(cache.glob("*/rank_0/ToyModel/saved_graph.json"))
    data = json.loads(plan.read_text())
    data["output"] = 7  # no such graph output: it would fail at every first forward
    plan.write_text(json.dumps(data))
    model = _warm_model(cache, dict(num_dynamo_traces=1, num_saved_graph_loads=0,
                                    num_inductor_compiles=0))
    assert "does not match its recorded checksum" in kiln_logs.text
    assert torch.equal(_run(model, 3), _run(cold["model"], 3))


def test_stale_saved_graph_entry_traces(cold, tmp_path):
    cache = tmp_path / "cache"
    shutil.copytree(cold["root"] / "cache", cache)
    entry = next((cache / "saved_graphs").glob("*.json"))
    source = tmp_path / "changed.py"
    source.write_text("x = 1\n")  # a traced file whose contents no longer match the key
    data = json.loads(entry.read_text())
    entry.write_text(json.dumps({**data, "traced_files": data["traced_files"] + [str(source)]}))
    _warm_model(cache, dict(num_dynamo_traces=1, num_saved_graph_loads=0,
                            num_inductor_compiles=0))
