"""An n > 1 request reaches the core once, with its samples' ids, and the core makes the child
requests: they share the parent's params fields (a whole-vocabulary logit_bias is decoded once,
not once per sample), each with its own seed, added all or none."""
import pytest

from kiln.core.engine_core import EngineCore
from kiln.core.parent_request import child_request_id
from kiln.core.request import Request
from kiln.sampling_params import SamplingParams

from .doubles import VOCAB, PagedTokenExecutor, make_config, make_request, run_until_done


def _parent(req_id: str, n: int, **params) -> tuple[Request, list[str]]:
    sp = SamplingParams(n=n, temperature=1.0, max_tokens=3, **params)
    return Request(req_id, [5, 6, 7], sp), [child_request_id(i, req_id) for i in range(n)]


def test_the_core_makes_the_samples_sharing_the_parents_fields():
    core = EngineCore(make_config(), PagedTokenExecutor)
    bias = {t: 0.5 for t in range(VOCAB)}
    parent, ids = _parent("r", 4, seed=7, logit_bias=bias, allowed_token_ids=list(range(9, 90)))
    core.add_request(parent, ids)
    children = [core.scheduler.requests[cid] for cid in ids]
    assert [c.sampling_params.seed for c in children] == [7, 8, 9, 10]  # as vLLM's: seed + i
    assert all(c.sampling_params.n == 1 for c in children)
    assert all(c.sampling_params.logit_bias is bias for c in children)
    assert all(c.sampling_params.allowed_token_ids is parent.sampling_params.allowed_token_ids
               for c in children)
    assert len({id(c.prompt_token_ids) for c in children}) == 4  # the prompts are their own
    assert "r" not in core.scheduler.requests  # the parent itself never runs
    results = run_until_done(core)
    assert sorted(results) == sorted(ids)


def test_an_unseeded_parents_samples_stay_unseeded():
    core = EngineCore(make_config(), PagedTokenExecutor)
    parent, ids = _parent("r", 2)
    core.add_request(parent, ids)
    assert [core.scheduler.requests[cid].sampling_params.seed for cid in ids] == [None, None]


def test_a_parent_whose_sample_cannot_be_added_adds_none_of_them():
    core = EngineCore(make_config(), PagedTokenExecutor)
    core.add_request(make_request("1_r", [1, 2, 3], max_tokens=2))  # takes sample 1's id
    parent, ids = _parent("r", 3)
    with pytest.raises(ValueError, match="1_r"):
        core.add_request(parent, ids)
    assert set(core.scheduler.requests) == {"1_r"}  # sample 0 taken back; the other untouched
    assert set(run_until_done(core)) == {"1_r"}


def test_a_parent_with_the_wrong_number_of_ids_is_refused():
    core = EngineCore(make_config(), PagedTokenExecutor)
    parent, ids = _parent("r", 3)
    with pytest.raises(ValueError, match="n=3"):
        core.add_request(parent, ids[:2])
    assert not core.scheduler.requests


def test_the_core_process_reports_every_sample_of_a_parent_it_could_not_add():
    """The front end awaits the samples, not the parent: each must end, or the request hangs."""
    import zmq

    from kiln.core.core_loop import CoreLoop
    from kiln.core.core_messages import StepOutputs, input_codec, output_codec, to_wire

    core = EngineCore(make_config(), PagedTokenExecutor)
    core.add_request(make_request("1_r", [1, 2, 3], max_tokens=2))
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    out_pull, out = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.bind("inproc://parent-add-fails")
    push.connect("inproc://parent-add-fails")
    out_pull.bind("inproc://parent-add-fails-out")
    out.connect("inproc://parent-add-fails-out")
    try:
        loop = CoreLoop(core, pull, out)
        encoder, _ = input_codec()
        _, decoder = output_codec()
        parent, ids = _parent("r", 2)
        push.send(encoder.encode(to_wire(parent, ids)))
        assert loop.drain(1000) is True
        report = decoder.decode(out_pull.recv())
        assert isinstance(report, StepOutputs)
        assert [(o.request_id, o.finish_reason) for o in report.outputs] == [
            ("0_r", "abort"), ("1_r", "abort")]
    finally:
        for s in (pull, push, out, out_pull):
            s.close(linger=0)
        ctx.term()
