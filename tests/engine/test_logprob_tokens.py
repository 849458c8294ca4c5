"""The token strings in `.logprobs` / `.prompt_logprobs`, ranks, and alignment with token_ids."""
import pytest
from engine.test_detokenizer import _byte_level_bpe

from kiln.core.outputs import EngineCoreOutput, LogprobsLists
from kiln.engine.output_processor import OutputProcessor
from kiln.sampling_params import RequestOutputKind, SamplingParams

pytestmark = pytest.mark.usefixtures("detokenizer_kind")


def ids_of(tokenizer, text):
    return tokenizer(text, add_special_tokens=False).input_ids


def lists(sampled, top=(), rank=1):
    top = list(top)
    return LogprobsLists(token_ids=[sampled] + top,
                         logprobs=[-1.0] + [-0.5 - i for i in range(len(top))], sampled_rank=rank)


def generate(tokenizer, ids, finish="length", **params):
    """One core output per token, each with logprobs; returns the final CompletionOutput."""
    proc = OutputProcessor(tokenizer)
    p = SamplingParams(output_kind=RequestOutputKind.FINAL_ONLY, **params)
    proc.add_request("r", "Once", tokenizer("Once").input_ids, [("r", p)], p.output_kind)
    for i, t in enumerate(ids):
        k = p.logprobs or 0
        res = proc.process_outputs([EngineCoreOutput(
            "r", [t], new_logprobs=[lists(t, ids[:k], rank=3)],
            finish_reason=finish if i == len(ids) - 1 else None)])
        if res.request_outputs:
            return res.request_outputs[0].outputs[0]
    raise AssertionError("the request did not finish")


def test_sentencepiece_tokens_keep_their_leading_space(tokenizer):
    """A lone "▁the" decodes to "the" (SentencePiece drops the first space of a text); the
    logprob entry must say " the", or the token strings no longer add up to the text."""
    ids = ids_of(tokenizer, "the cat sat on the mat")
    assert tokenizer.convert_ids_to_tokens(ids[:1]) == ["▁the"]
    out = generate(tokenizer, ids, logprobs=0)
    pieces = [step[t].decoded_token for t, step in zip(out.token_ids, out.logprobs)]
    assert pieces[0] == " the"
    assert "".join(pieces) == out.text == " the cat sat on the mat"


def test_byte_level_tokens_are_their_own_decode():
    tok = _byte_level_bpe()
    ids = ids_of(tok, "once upon a time")
    out = generate(tok, ids, logprobs=1)
    for step in out.logprobs:
        for cand, lp in step.items():
            assert lp.decoded_token == tok.decode([cand])
    assert "".join(s[t].decoded_token for t, s in zip(out.token_ids, out.logprobs)) == out.text


def test_byte_fallback_and_special_tokens_decode_alone(tokenizer):
    """A lone byte of a multi-byte character is U+FFFD, as its own decode; specials show."""
    e6 = tokenizer.convert_tokens_to_ids("<0xE6>")
    out = generate(tokenizer, [e6, 2], finish="stop", logprobs=0)
    assert out.logprobs[0][e6].decoded_token == "\ufffd" == tokenizer.decode([e6])
    assert out.logprobs[1][2].decoded_token == "</s>"


def test_prompt_logprob_tokens_keep_leading_space(tokenizer):
    proc = OutputProcessor(tokenizer)
    p = SamplingParams(prompt_logprobs=0, output_kind=RequestOutputKind.FINAL_ONLY)
    prompt = tokenizer("Once upon a time").input_ids
    proc.add_request("r", "Once upon a time", prompt, [("r", p)], p.output_kind)
    plp = [lists(t) for t in prompt[1:]]
    (out,) = proc.process_outputs([EngineCoreOutput("r", [5], finish_reason="length",
                                                    prompt_logprobs=plp)]).request_outputs
    assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
    text = "".join(e[t].decoded_token for t, e in zip(prompt[1:], out.prompt_logprobs[1:]))
    assert text == " Once upon a time"


def test_sampled_token_first_with_its_rank_and_logprobs_zero_only_sampled(tokenizer):
    ids = ids_of(tokenizer, "a cat")
    out = generate(tokenizer, ids, logprobs=0)
    assert all(list(step) == [t] and step[t].rank == 3 for t, step in zip(ids, out.logprobs))
    out = generate(tokenizer, ids, logprobs=2)
    for t, step in zip(ids, out.logprobs):
        # listed among the top 2 (ids[:2]), its rank is its position there, as vLLM's dict
        # of [sampled, top...] keeps the later entry
        rank = ids[:2].index(t) + 1 if t in ids[:2] else 3
        assert next(iter(step)) == t and step[t].rank == rank
        assert len(step) <= 3


@pytest.mark.parametrize("kind", list(RequestOutputKind))
def test_stop_string_cuts_text_but_tokens_and_logprobs_stay_aligned(tokenizer, kind):
    proc = OutputProcessor(tokenizer)
    p = SamplingParams(stop=["cat"], logprobs=1, output_kind=kind)
    proc.add_request("r", "Once", tokenizer("Once").input_ids, [("r", p)], kind)
    ids = ids_of(tokenizer, "a cat sat on the mat")
    outs = []
    for t in ids:
        res = proc.process_outputs([EngineCoreOutput("r", [t], new_logprobs=[lists(t, [t])])])
        outs += [o.outputs[0] for o in res.request_outputs]
        if res.reqs_to_finish:
            break
    if kind == RequestOutputKind.DELTA:
        token_ids = sum((o.token_ids for o in outs), [])
        logprobs = sum((o.logprobs for o in outs), [])
        text = "".join(o.text for o in outs)
    else:
        token_ids, logprobs, text = outs[-1].token_ids, outs[-1].logprobs, outs[-1].text
    assert text == " a "
    assert token_ids == ids[:len(token_ids)] and "cat" in tokenizer.decode(token_ids)
    assert len(logprobs) == len(token_ids)
    assert all(t in step for t, step in zip(token_ids, logprobs))
