"""OutputProcessor over hand-made EngineCoreOutputs: output kinds, n > 1, stops, logprobs."""
import pytest

from kiln.core.outputs import EngineCoreOutput, LogprobsLists
from kiln.core.parent_request import child_params, child_request_id
from kiln.engine.output_processor import OutputProcessor
from kiln.sampling_params import RequestOutputKind, SamplingParams

pytestmark = pytest.mark.usefixtures("detokenizer_kind")

EOS = 2


def words(tokenizer, text):
    return tokenizer(text, add_special_tokens=False).input_ids


def add(proc, rid, tokenizer, kind=RequestOutputKind.CUMULATIVE, n=1, **params):
    p = SamplingParams(n=n, output_kind=kind, **params)
    prompt = tokenizer("Once upon a time").input_ids
    if n == 1:
        samples = [(rid, p)]
    else:
        samples = [(child_request_id(i, rid), child_params(p, i)) for i in range(n)]
    proc.add_request(rid, "Once upon a time", prompt, samples, kind)
    return [cid for cid, _ in samples]


def feed(proc, rid, ids, last_finish=None, stop_reason=None):
    """One core output per token; returns the RequestOutputs of every step."""
    results = []
    for i, t in enumerate(ids):
        finish = last_finish if i == len(ids) - 1 else None
        out = EngineCoreOutput(rid, [t], finish_reason=finish,
                               stop_reason=stop_reason if finish else None)
        results.append(proc.process_outputs([out]))
    return results


def test_cumulative_outputs_grow_and_finish(tokenizer):
    proc = OutputProcessor(tokenizer)
    add(proc, "r", tokenizer)
    ids = words(tokenizer, "there was a cat")
    steps = feed(proc, "r", ids, last_finish="length")
    texts = [s.request_outputs[0].outputs[0].text for s in steps]
    assert texts[-1] == " there was a cat"
    assert all(texts[i + 1].startswith(texts[i]) for i in range(len(texts) - 1))
    last = steps[-1].request_outputs[0]
    assert last.finished and last.outputs[0].finish_reason == "length"
    assert last.outputs[0].token_ids == ids
    assert last.prompt == "Once upon a time"
    assert not proc.has_unfinished_requests()


def test_delta_outputs_carry_only_new_text_and_tokens(tokenizer):
    proc = OutputProcessor(tokenizer)
    add(proc, "r", tokenizer, kind=RequestOutputKind.DELTA)
    ids = words(tokenizer, "there was a cat")
    steps = feed(proc, "r", ids, last_finish="length")
    outs = [s.request_outputs[0].outputs[0] for s in steps if s.request_outputs]
    assert "".join(o.text for o in outs) == " there was a cat"
    assert sum((o.token_ids for o in outs), []) == ids
    assert all(len(o.token_ids) == 1 for o in outs)


def test_final_only_emits_once(tokenizer):
    proc = OutputProcessor(tokenizer)
    add(proc, "r", tokenizer, kind=RequestOutputKind.FINAL_ONLY)
    ids = words(tokenizer, "there was a cat") + [EOS]
    steps = feed(proc, "r", ids, last_finish="stop")
    assert [len(s.request_outputs) for s in steps] == [0] * (len(ids) - 1) + [1]
    out = steps[-1].request_outputs[0].outputs[0]
    # The eos token is in token_ids but its text is not in the output.
    assert out.text == " there was a cat" and out.token_ids[-1] == EOS
    assert out.finish_reason == "stop" and out.stop_reason is None


def test_stop_token_text_excluded_and_reported(tokenizer):
    proc = OutputProcessor(tokenizer)
    dot = words(tokenizer, ".")[-1]
    add(proc, "r", tokenizer, stop_token_ids=[dot])
    steps = feed(proc, "r", words(tokenizer, "the cat") + [dot], last_finish="stop",
                 stop_reason=dot)
    out = steps[-1].request_outputs[0].outputs[0]
    assert out.text == " the cat" and out.stop_reason == dot


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_finishes_and_asks_core_to_abort(tokenizer, include):
    proc = OutputProcessor(tokenizer)
    add(proc, "r", tokenizer, stop=["cat"], include_stop_str_in_output=include)
    ids = words(tokenizer, "there was a cat and a dog")
    aborts, final = [], None
    for t in ids:
        res = proc.process_outputs([EngineCoreOutput("r", [t])])
        aborts += res.reqs_to_finish
        if res.request_outputs and res.request_outputs[0].finished:
            final = res.request_outputs[0]
            break
    assert aborts == ["r"]
    assert final.outputs[0].finish_reason == "stop" and final.outputs[0].stop_reason == "cat"
    assert final.outputs[0].text == (" there was a cat" if include else " there was a ")
    # Later core outputs for the ended request are ignored.
    assert proc.process_outputs([EngineCoreOutput("r", [5])]).request_outputs == []


def test_n_samples_aggregate_in_index_order(tokenizer):
    proc = OutputProcessor(tokenizer)
    ids = add(proc, "p", tokenizer, kind=RequestOutputKind.FINAL_ONLY, n=3, seed=7)
    assert ids == ["0_p", "1_p", "2_p"]
    a, b, c = (words(tokenizer, w) for w in ("a cat", "a dog", "the sun"))
    # Children finish out of order; nothing is emitted until the last one.
    r1 = proc.process_outputs([EngineCoreOutput("2_p", c, finish_reason="length"),
                               EngineCoreOutput("0_p", a)])
    r2 = proc.process_outputs([EngineCoreOutput("1_p", b, finish_reason="length")])
    assert r1.request_outputs == [] and r2.request_outputs == []
    r3 = proc.process_outputs([EngineCoreOutput("0_p", [EOS], finish_reason="stop")])
    (out,) = r3.request_outputs
    assert out.request_id == "p" and out.finished
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert [o.text for o in out.outputs] == [" a cat", " a dog", " the sun"]
    assert not proc.has_unfinished_requests()


def test_n_samples_cumulative_not_finished_until_all(tokenizer):
    proc = OutputProcessor(tokenizer)
    add(proc, "p", tokenizer, n=2)
    r = proc.process_outputs([EngineCoreOutput("1_p", [300], finish_reason="length")])
    (out,) = r.request_outputs
    assert not out.finished and len(out.outputs) == 2
    assert out.outputs[1].finish_reason == "length" and out.outputs[0].finish_reason is None


def test_child_params_seeds_and_n():
    p = SamplingParams(n=3, seed=10, temperature=0.8)
    kids = [child_params(p, i) for i in range(3)]
    assert [k.seed for k in kids] == [10, 11, 12] and all(k.n == 1 for k in kids)
    assert p.n == 3 and p.seed == 10
    assert child_params(SamplingParams(n=2), 1).seed is None


def test_child_params_share_the_lists_nothing_changes():
    """A deep copy per sample rebuilt every bad word's ids n times on the engine thread: 5,000
    words at n=64 held every other stream on the server for 6 s."""
    p = SamplingParams(n=4, bad_words=["a", "b"], stop=["x"], logit_bias={5: 1.0})
    p.bad_words_token_ids = [[1], [2, 3]]
    kids = [child_params(p, i) for i in range(4)]
    for k in kids:
        assert k.bad_words_token_ids is p.bad_words_token_ids and k.stop is p.stop
        assert k.logit_bias is p.logit_bias and k.bad_words is p.bad_words
    assert p.n == 4 and {k.n for k in kids} == {1}


def test_logprobs_dicts_and_cumulative(tokenizer):
    proc = OutputProcessor(tokenizer)
    add(proc, "r", tokenizer, logprobs=2)
    lp1 = LogprobsLists(token_ids=[300, 300, 301], logprobs=[-0.5, -0.5, -1.5], sampled_rank=1)
    lp2 = LogprobsLists(token_ids=[302, 303, 304], logprobs=[-3.0, -0.1, -0.2], sampled_rank=5)
    proc.process_outputs([EngineCoreOutput("r", [300], new_logprobs=[lp1])])
    (out,) = proc.process_outputs([EngineCoreOutput("r", [302], new_logprobs=[lp2],
                                                    finish_reason="length")]).request_outputs
    c = out.outputs[0]
    assert c.cumulative_logprob == pytest.approx(-3.5)
    assert len(c.logprobs) == 2
    assert set(c.logprobs[0]) == {300, 301} and c.logprobs[0][300].rank == 1
    assert c.logprobs[0][301].rank == 2
    assert c.logprobs[1][302].rank == 5 and c.logprobs[1][303].rank == 1
    assert c.logprobs[1][302].decoded_token == tokenizer.decode([302])


def test_logprob_token_texts_are_decoded_once_per_id(tokenizer):
    class Counting:
        def __init__(self):
            self.calls = []

        def decode(self, ids, **kw):
            self.calls.append(list(ids))
            return tokenizer.decode(ids, **kw)

        def __getattr__(self, name):
            return getattr(tokenizer, name)

    counting = Counting()
    proc = OutputProcessor(counting)
    add(proc, "r", tokenizer, logprobs=2)
    for _ in range(3):  # the same three ids at every step
        lists = LogprobsLists(token_ids=[300, 301, 302], logprobs=[-0.5, -1.0, -2.0],
                              sampled_rank=1)
        proc.process_outputs([EngineCoreOutput("r", [300], new_logprobs=[lists])])
    # 301 and 302 are never sampled: only the logprob entries decode them
    assert sorted(c for c in counting.calls if c in ([301], [302])) == [[301], [302]]


def test_no_logprobs_requested_gives_none(tokenizer):
    proc = OutputProcessor(tokenizer)
    add(proc, "r", tokenizer)
    (out,) = proc.process_outputs([EngineCoreOutput("r", [300])]).request_outputs
    assert out.outputs[0].logprobs is None and out.outputs[0].cumulative_logprob is None


def test_abort_returns_unfinished_core_ids(tokenizer):
    proc = OutputProcessor(tokenizer)
    add(proc, "p", tokenizer, n=2)
    proc.process_outputs([EngineCoreOutput("0_p", [300], finish_reason="length")])
    assert proc.abort_requests(["p", "unknown"]) == ["1_p"]
    assert not proc.has_unfinished_requests()


def test_duplicate_request_id_rejected(tokenizer):
    proc = OutputProcessor(tokenizer)
    add(proc, "r", tokenizer)
    with pytest.raises(ValueError, match="already in use"):
        add(proc, "r", tokenizer)
