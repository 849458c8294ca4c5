"""Stop strings, stop tokens, eos and min_tokens as the OutputProcessor reports them, per kind.

Core outputs are hand-made (one token per step, as the scheduler sends), so no model is needed.
"""
import pytest

from kiln.core.outputs import EngineCoreOutput
from kiln.core.parent_request import child_params, child_request_id
from kiln.engine.output_processor import OutputProcessor
from kiln.sampling_params import RequestOutputKind, SamplingParams

pytestmark = pytest.mark.usefixtures("detokenizer_kind")

EOS = 2
PROMPT = "Once upon a time"


def ids_of(tokenizer, text):
    return tokenizer(text, add_special_tokens=False).input_ids


def start(tokenizer, kind=RequestOutputKind.CUMULATIVE, n=1, **params):
    proc = OutputProcessor(tokenizer)
    p = SamplingParams(n=n, output_kind=kind, **params)
    samples = ([("r", p)] if n == 1 else
               [(child_request_id(i, "r"), child_params(p, i)) for i in range(n)])
    proc.add_request("r", PROMPT, tokenizer(PROMPT).input_ids, samples, kind)
    return proc


def run(proc, ids, core_id="r", finish=None, stop_reason=None):
    """Feed one token per step until the request ends; returns (outputs, core ids to finish)."""
    outs, to_finish = [], []
    for i, t in enumerate(ids):
        last = i == len(ids) - 1
        res = proc.process_outputs([EngineCoreOutput(
            core_id, [t], finish_reason=finish if last else None,
            stop_reason=stop_reason if last else None)])
        outs += res.request_outputs
        to_finish += res.reqs_to_finish
        if res.request_outputs and res.request_outputs[-1].finished:
            break
    return outs, to_finish


def test_cumulative_text_never_shows_what_a_stop_string_takes_back(tokenizer):
    """Each CUMULATIVE output extends the previous one: a possible start of a stop string is
    held back (as in DELTA), not shown and then cut when the stop string completes."""
    proc = start(tokenizer, stop=["stop!"])
    outs, _ = run(proc, ids_of(tokenizer, "we stop! now"))
    texts = [o.outputs[0].text for o in outs]
    assert texts[-1] == " we " and outs[-1].outputs[0].stop_reason == "stop!"
    for before, after in zip(texts, texts[1:]):
        assert after.startswith(before), texts


def test_cumulative_hold_back_is_released_when_no_stop_follows(tokenizer):
    proc = start(tokenizer, stop=["stop!"])
    outs, _ = run(proc, ids_of(tokenizer, "we sto and go"), finish="length")
    texts = [o.outputs[0].text for o in outs]
    assert texts[-1] == " we sto and go" and outs[-1].outputs[0].finish_reason == "length"
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:]))


def test_stop_string_spanning_tokens_and_inside_first_token(tokenizer):
    ids = ids_of(tokenizer, "the big dog")
    assert len(ids) >= 3
    # "e big d" spans at least three tokens
    outs, to_finish = run(start(tokenizer, stop=["e big d"]), ids)
    assert outs[-1].outputs[0].text == " th" and to_finish == ["r"]
    # "he" lies inside the first token ("▁the")
    outs, to_finish = run(start(tokenizer, stop=["he"]), ids)
    assert len(outs) == 1 and outs[0].outputs[0].text == " t"
    assert outs[0].outputs[0].token_ids == ids[:1] and to_finish == ["r"]


def test_earliest_stop_string_in_the_text_wins(tokenizer):
    """Both end in the same token's text; the one starting earlier cuts the text, not the first
    in the list as vLLM's detokenizer would (" a dog "; docs/server.md says why Kiln differs)."""
    ids = ids_of(tokenizer, "a dog ran")
    outs, _ = run(start(tokenizer, stop=["ran", "og ran"]), ids)
    assert outs[-1].outputs[0].text == " a d" and outs[-1].outputs[0].stop_reason == "og ran"


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_wins_over_max_tokens_in_the_same_step(tokenizer, include):
    ids = ids_of(tokenizer, "a dog ran")
    k = next(k for k in range(1, len(ids) + 1) if "dog" in tokenizer.decode(ids[:k]))
    # max_tokens = k: the core ends it with "length" in the step whose token completes "dog"
    outs, to_finish = run(start(tokenizer, stop=["dog"], include_stop_str_in_output=include),
                          ids[:k], finish="length")
    c = outs[-1].outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == "dog"
    assert c.text == (" a dog" if include else " a ")
    assert to_finish == []  # the core already ended it


@pytest.mark.parametrize("include", [False, True])
def test_stop_token_id_reported_and_its_text_kept_only_if_asked(tokenizer, include):
    dot = ids_of(tokenizer, "cat.")[-1]
    ids = ids_of(tokenizer, "a cat") + [dot]
    proc = start(tokenizer, stop_token_ids=[dot], include_stop_str_in_output=include)
    outs, _ = run(proc, ids, finish="stop", stop_reason=dot)
    c = outs[-1].outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == dot and c.token_ids == ids
    assert c.text == (" a cat." if include else " a cat")


@pytest.mark.parametrize("kind", list(RequestOutputKind))
def test_a_stop_token_kept_in_the_text_is_searched_for_stop_strings(tokenizer, kind):
    # vLLM (BaseIncrementalDetokenizer.update since PR #23938) decodes the stop token's text
    # when include_stop_str_in_output keeps it and searches it like all new text: a stop string
    # found there is the stop reason and the text ends with it. Kiln (5d65587) followed the
    # older vLLM that skipped the search after a stop token, keeping the whole token instead.
    ids = ids_of(tokenizer, "a cat.")
    dot = ids[-1]
    proc = start(tokenizer, kind, stop=["."], stop_token_ids=[dot],
                 include_stop_str_in_output=True)
    outs = run(proc, ids, finish="stop", stop_reason=dot)[0]
    c = outs[-1].outputs[0]
    text = "".join(o.outputs[0].text for o in outs) if kind == RequestOutputKind.DELTA else c.text
    assert (c.finish_reason, c.stop_reason, text) == ("stop", ".", " a cat.")
    # A stop string ending inside the stop token's text: "king" is "▁k" "ing".
    king = ids_of(tokenizer, "a king")
    proc = start(tokenizer, kind, stop=["kin"], stop_token_ids=[king[-1]],
                 include_stop_str_in_output=True)
    outs = run(proc, king, finish="stop", stop_reason=king[-1])[0]
    c = outs[-1].outputs[0]
    text = "".join(o.outputs[0].text for o in outs) if kind == RequestOutputKind.DELTA else c.text
    assert (c.stop_reason, text) == ("kin", " a kin")
    # Without include_stop_str_in_output the token's text is not decoded, so not searched.
    proc = start(tokenizer, stop=["kin"], stop_token_ids=[king[-1]])
    c = run(proc, king, finish="stop", stop_reason=king[-1])[0][-1].outputs[0]
    assert (c.stop_reason, c.text) == (king[-1], " a k")


def test_eos_ends_without_stop_reason_and_with_skip_false_its_text_is_dropped(tokenizer):
    ids = ids_of(tokenizer, "a cat") + [EOS]
    outs, _ = run(start(tokenizer, skip_special_tokens=False), ids, finish="stop")
    c = outs[-1].outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason is None
    assert c.text == " a cat" and c.token_ids[-1] == EOS


def test_min_tokens_defers_stop_strings(tokenizer):
    ids = ids_of(tokenizer, "a b a b a b")
    outs, _ = run(start(tokenizer, stop=["b"], min_tokens=3), ids, finish="length")
    c = outs[-1].outputs[0]
    # tokens "▁a ▁b ▁a ▁b ...": the "b" of token 2 is too early, the one of token 4 stops it
    assert ids[:4] == [ids[0], ids[1]] * 2
    assert c.finish_reason == "stop" and c.stop_reason == "b"
    assert c.token_ids == ids[:4] and c.text == " a b a "


def test_n_samples_stop_independently(tokenizer):
    proc = start(tokenizer, kind=RequestOutputKind.FINAL_ONLY, n=2, stop=["dog"], seed=1)
    # Sample 0 hits "dog"; the core may still send its next tokens (they are in flight when
    # the engine asks it to finish the request): they must not reach the stopped output.
    out0, fin0 = run(proc, ids_of(tokenizer, "a dog ran far"), core_id="0_r")
    assert out0 == [] and fin0 == ["0_r"]  # FINAL_ONLY: nothing until both end
    out1, fin1 = run(proc, ids_of(tokenizer, "a cat ran"), core_id="1_r", finish="length")
    assert fin1 == []
    (final,) = out1
    a, b = final.outputs
    assert (a.text, a.finish_reason, a.stop_reason) == (" a ", "stop", "dog")
    assert a.token_ids == ids_of(tokenizer, "a dog")
    assert (b.text, b.finish_reason, b.stop_reason) == (" a cat ran", "length", None)


def test_delta_stream_with_stop_concatenates_to_the_final_text(tokenizer):
    ids = ids_of(tokenizer, "we stop! now")
    outs, _ = run(start(tokenizer, kind=RequestOutputKind.DELTA, stop=["stop!"]), ids)
    assert "".join(o.outputs[0].text for o in outs) == " we "
    streamed_ids = sum((o.outputs[0].token_ids for o in outs), [])
    assert streamed_ids == ids[:len(streamed_ids)] and len(streamed_ids) < len(ids)
    # a stop string inside the first token: the one delta is already cut
    outs, _ = run(start(tokenizer, kind=RequestOutputKind.DELTA, stop=["e"]), ids)
    assert [o.outputs[0].text for o in outs] == [" w"]


def test_empty_stop_string_refused():
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop=[""])


def test_detokenize_false_refuses_stop_strings():
    with pytest.raises(ValueError, match="detokenize=False"):
        SamplingParams(detokenize=False, stop=["x"])
    p = SamplingParams(detokenize=False, stop_token_ids=[5])  # ids need no text
    p.stop = "late"  # set after construction: the engine's verify() catches it
    with pytest.raises(ValueError, match="detokenize=False"):
        p.verify()


def test_detokenize_false_gives_token_ids_without_text(tokenizer):
    from kiln.core.outputs import LogprobsLists

    proc = start(tokenizer, detokenize=False, logprobs=1)
    ids = ids_of(tokenizer, "a cat sat")
    for i, t in enumerate(ids):
        lp = LogprobsLists(token_ids=[t, t], logprobs=[-1.0, -1.0], sampled_rank=1)
        res = proc.process_outputs([EngineCoreOutput(
            "r", [t], new_logprobs=[lp], finish_reason="length" if i == len(ids) - 1 else None)])
    c = res.request_outputs[0].outputs[0]
    assert c.text == "" and c.token_ids == ids and c.finish_reason == "length"
    assert all(step[t].decoded_token is None for t, step in zip(ids, c.logprobs))


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("kind", list(RequestOutputKind))
def test_stop_string_in_a_byte_run_the_stop_token_ends_is_found(tokenizer, include, kind):
    # "\n" is the byte token <0x0A> here (as in Llama-2 / Mistral): a byte run's text is held
    # until the run ends, and eos ended it. Kiln flushed "\n" unsearched: the text kept the
    # newline and stop_reason was None; vLLM stops on the string.
    ids = ids_of(tokenizer, "a cat\n")
    assert tokenizer.convert_ids_to_tokens(ids[-1:]) == ["<0x0A>"]
    proc = start(tokenizer, kind, stop=["\n"], include_stop_str_in_output=include,
                 skip_special_tokens=False)
    outs, _ = run(proc, ids + [EOS], finish="stop")
    texts = [o.outputs[0].text for o in outs]
    c = outs[-1].outputs[0]
    assert (c.finish_reason, c.stop_reason) == ("stop", "\n")
    text = "".join(texts) if kind == RequestOutputKind.DELTA else texts[-1]
    assert text == (" a cat\n" if include else " a cat")


def test_min_tokens_holds_for_text_a_stop_token_releases(tokenizer):
    # " a" "\n"(<0x0A>) then eos as token 3 of min_tokens=3: the newline is token 2's text,
    # too early to end a stop string, though it is released only when eos ends the run.
    ids = ids_of(tokenizer, "a\n")
    proc = start(tokenizer, stop=["\n"], min_tokens=3)
    c = run(proc, ids + [EOS], finish="stop")[0][-1].outputs[0]
    assert (c.finish_reason, c.stop_reason, c.text) == ("stop", None, " a\n")


def test_a_stop_string_in_a_byte_run_stops_the_request_when_its_last_byte_arrives(tokenizer):
    # "😀日😀..." spelled in byte tokens: the stop string "日" is whole at its third byte, and
    # the request stops there (the core is told to finish it) instead of running on to the
    # end of the run; the emoji before it streamed already.
    data = "😀日😀😀".encode()
    ids = [tokenizer.convert_tokens_to_ids(f"<0x{b:02X}>") for b in data]
    proc = start(tokenizer, RequestOutputKind.DELTA, stop=["日"])
    outs, to_finish = run(proc, ids, finish="length")
    assert to_finish == ["r"] and len(outs) == len("😀日".encode())
    assert [o.outputs[0].text for o in outs if o.outputs[0].text] == ["😀"]
    assert outs[-1].outputs[0].stop_reason == "日"
