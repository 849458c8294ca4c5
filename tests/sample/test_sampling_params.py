"""SamplingParams' validation: every bad value is a ValueError naming the field and its range."""
import math

import pytest

from kiln.sampling_params import SamplingParams


@pytest.mark.parametrize("field,value", [
    ("n", 0), ("temperature", -0.5), ("temperature", math.inf), ("temperature", math.nan),
    ("temperature", 1e39),  # inf in the sampler's float32: rows sampled token 0
    ("top_p", 0), ("top_p", 1.5), ("top_k", -2), ("min_p", 1.5),
    ("presence_penalty", 3), ("frequency_penalty", -3),
    # 1e-50 is 0 in float32: the sampler's logits would become NaN
    ("repetition_penalty", 0), ("repetition_penalty", 1e-50),
    ("repetition_penalty", 1e7), ("repetition_penalty", math.inf), ("output_kind", 7), ("output_kind", True),
    ("max_tokens", 0), ("min_tokens", -1), ("logprobs", -2), ("prompt_logprobs", -2),
    ("logprobs", 1.5),  # above the cap (--max-logprobs) is the engine's to refuse
    # torch generators take 64 bits
    ("seed", 2 ** 63), ("seed", -2 ** 63 - 1), ("seed", 1.5),
    ("stop", [""]), ("stop_token_ids", [-1]), ("spaces_between_special_tokens", 0),
    ("stop", [f"s{i}" for i in range(257)]),  # each is searched after every token
    ("stop_token_ids", list(range(1025))),
])
def test_bad_values_name_the_field(field, value):
    with pytest.raises(ValueError, match=rf"^{field} must be"):
        SamplingParams(**{field: value})


@pytest.mark.parametrize("fields,where", [
    (dict(max_tokens=2 ** 64), "max_tokens"),
    (dict(min_tokens=2 ** 64, max_tokens=None), "min_tokens"), (dict(top_k=10 ** 30), "top_k"),
    (dict(logprobs=2 ** 63), "logprobs"), (dict(truncate_prompt_tokens=2 ** 63),
                                           "truncate_prompt_tokens"),
    (dict(stop_token_ids=[3, 2 ** 64]), r"stop_token_ids\[1\]"),
    (dict(allowed_token_ids=[2 ** 64]), r"allowed_token_ids\[0\]"),
    (dict(logit_bias={2 ** 64: 1.0}), "logit_bias key"),
    (dict(structured_outputs={"json": {"enum": ["a", 2 ** 64]}}),
     r"structured_outputs.json\['enum'\]\[1\]"),
])
def test_an_int_past_64_bits_is_refused_naming_where_and_the_limit(fields, where):
    """Every field crosses to the engine core as msgpack: past 64 bits the core client's encoder
    failed (OverflowError) as LLM.generate handed the request over. (n: its own cap, below.)"""
    with pytest.raises(ValueError, match=rf"^{where} must be within a 64-bit integer's range "
                                         r"\[-9223372036854775808, 9223372036854775807\]"):
        SamplingParams(**fields)


def test_edges_that_are_allowed():
    SamplingParams(seed=2 ** 63 - 1, n=4)  # the samples' seeds go past int64: fine for torch
    assert SamplingParams(seed=-1).seed is None  # vLLM's "no seed": it was a fixed seed
    # vLLM's whole vocabulary; the engine resolves it against --max-logprobs
    assert SamplingParams(logprobs=-1, prompt_logprobs=-1).logprobs == -1
    SamplingParams(seed=-2 ** 63, temperature=0, repetition_penalty=1e-6, top_k=-1)
    SamplingParams(repetition_penalty=2.5)  # vLLM and HF take any positive penalty
    assert SamplingParams(min_tokens=16, max_tokens=16).min_tokens == 16
    with pytest.raises(ValueError, match="min_tokens must be <= max_tokens"):
        SamplingParams(min_tokens=17, max_tokens=16)


def test_top_k_of_the_vocabulary_or_more_is_off():
    p = SamplingParams(top_k=2 ** 63 - 1)  # the most that crosses to the core: off
    p.update_from_tokenizer(eos_token_id=2, vocab_size=512)
    assert p.top_k == 0
    p = SamplingParams(top_k=511)
    p.update_from_tokenizer(eos_token_id=2, vocab_size=512)
    assert p.top_k == 511


@pytest.mark.parametrize("field,value", [("stop", "a\ud800"), ("stop", ["ok", "\udfff"]),
                                         ("bad_words", ["\ud83d"])])
def test_a_lone_surrogate_in_text_the_engine_encodes_names_the_field(field, value):
    """JSON's "\\ud800" decodes to a lone surrogate: a stop string failed to encode on its way
    to the engine core (a bare UnicodeEncodeError), a bad word in the tokenizer (a TypeError)."""
    with pytest.raises(ValueError, match=rf"^{field} contains a lone UTF-16 surrogate"):
        SamplingParams(**{field: value})
    SamplingParams(**{field: "a\x00\x1b"})  # NUL and control characters are text: vLLM's too


@pytest.mark.parametrize("kind,value", [
    ("regex", "a\ud800"), ("choice", ["ok", "\udfff"]), ("grammar", 'root ::= "\ud800"'),
    ("json", {"enum": ["\ud800"]}), ("json", '{"const": "\ud800"}')])
def test_a_lone_surrogate_in_structured_outputs_names_the_field(kind, value):
    """The grammar compiler failed with a bare codec error; reasoning_end failed on its way to
    the engine core."""
    from kiln.sampling_params import StructuredOutputsParams

    with pytest.raises(ValueError, match=rf"^structured_outputs\.{kind} contains a lone UTF-16"):
        StructuredOutputsParams(**{kind: value})
    with pytest.raises(ValueError, match=r"^structured_outputs\.reasoning_end contains a lone"):
        StructuredOutputsParams(regex="a", reasoning_end="</think>\ud800")
    StructuredOutputsParams(choice=["a\x00", "é"])


def test_n_and_beam_width_past_vllms_sequence_cap_are_refused_naming_the_variable(monkeypatch):
    """Each sample is a request in the engine: n=2**40 ran LLM.generate out of memory making
    them. vLLM's cap (VLLM_MAX_N_SEQUENCES, default 16,384), read under Kiln's name first."""
    from kiln.beam_search import BeamSearchParams

    SamplingParams(n=16384, temperature=1.0)
    with pytest.raises(ValueError, match=r"^n must be at most 16384, got 16385; .*"
                                         r"KILN_MAX_N_SEQUENCES"):
        SamplingParams(n=16385)
    monkeypatch.setenv("VLLM_MAX_N_SEQUENCES", "4")
    SamplingParams(n=4)
    with pytest.raises(ValueError, match=r"^n must be at most 4, got 5; .*VLLM_MAX_N_SEQUENCES"):
        SamplingParams(n=5)
    with pytest.raises(ValueError, match=r"^beam_width must be at most 4, got 5"):
        BeamSearchParams(beam_width=5, max_tokens=2)
    monkeypatch.setenv("KILN_MAX_N_SEQUENCES", "8")  # Kiln's wins where both are set
    SamplingParams(n=8)


def test_numpy_numbers_are_taken_as_the_python_numbers_they_equal():
    """vLLM takes max_tokens=np.int64(8), seed=np.int64(1); Kiln's checks refused them ("must be
    an integer"), and msgpack, which carries the params to the engine core, encodes no numpy
    scalar. They become Python's, which the checks (the 64-bit one too) then judge."""
    np = pytest.importorskip("numpy")
    from kiln.beam_search import BeamSearchParams
    from kiln.core.core_messages import decode_params, encode_params, input_codec

    p = SamplingParams(n=np.int32(2), max_tokens=np.int64(8), seed=np.int64(1),
                       temperature=np.float32(0.5), top_p=np.float16(0.5), top_k=np.uint8(3),
                       min_tokens=np.int64(2), logprobs=np.int64(1),
                       stop_token_ids=(np.int64(3), 4), allowed_token_ids=[np.int16(5)],
                       logit_bias={np.int64(6): np.float32(2.0), 7: -1.0},
                       repetition_detection={"max_pattern_size": np.int64(2),
                                             "min_count": np.int64(3)})
    got = {name: getattr(p, name) for name in ("n", "max_tokens", "seed", "temperature",
                                               "top_p", "top_k", "min_tokens", "logprobs")}
    assert got == dict(n=2, max_tokens=8, seed=1, temperature=0.5, top_p=0.5, top_k=3,
                       min_tokens=2, logprobs=1)
    assert all(type(v) in (int, float) for v in got.values()), got
    assert p.stop_token_ids == [3, 4] and p.allowed_token_ids == [5]
    assert p.logit_bias == {6: 2.0, 7: -1.0}
    assert {type(v) for v in (*p.stop_token_ids, *p.allowed_token_ids, *p.logit_bias,
                              *p.logit_bias.values())} <= {int, float}
    assert type(p.repetition_detection.min_count) is int
    encoder, _ = input_codec()
    assert decode_params(_msgpack_roundtrip(encoder, encode_params(p))) == p
    beams = BeamSearchParams(beam_width=np.int64(2), max_tokens=np.int64(4),
                             temperature=np.float32(0.0))
    assert (beams.beam_width, beams.max_tokens) == (2, 4) and type(beams.beam_width) is int

    with pytest.raises(ValueError, match=r"^seed must be None or an integer in \[-9223372036"):
        SamplingParams(seed=np.uint64(2 ** 64 - 1))
    with pytest.raises(ValueError, match=r"^max_tokens must be within a 64-bit integer's range"):
        SamplingParams(max_tokens=np.uint64(2 ** 63))
    with pytest.raises(ValueError, match=r"^max_tokens must be an integer >= 1"):
        SamplingParams(max_tokens=np.float64(8.0))  # a float, as 8.0 is
    with pytest.raises(ValueError, match=r"^ignore_eos must be True or False"):
        SamplingParams(ignore_eos=np.True_)  # no number: left to the field's check


def _msgpack_roundtrip(encoder, fields: dict) -> dict:
    import msgspec

    return msgspec.msgpack.decode(encoder.encode(fields))


def test_extra_args_are_refused_saying_why_and_their_default_taken():
    """vLLM's extra_args feed custom logits processors and plugins, which Kiln does not load
    (its server refuses vllm_xargs likewise): a TypeError (unexpected keyword) before."""
    from dataclasses import fields

    with pytest.raises(ValueError, match="^extra_args is not supported: .*custom logits "
                                         "processors and plugins"):
        SamplingParams(extra_args={"target_token": 67})
    assert SamplingParams(extra_args=None) == SamplingParams(extra_args={}) == SamplingParams()
    assert "extra_args" not in {f.name for f in fields(SamplingParams)}  # nothing to the core


def test_vllms_other_arguments_are_taken_or_refused_naming_the_replacement():
    """vLLM callers' SamplingParams(...) met a bare TypeError (unexpected keyword)."""
    from dataclasses import fields

    with pytest.raises(ValueError, match="^logits_processors is not supported: .*logit_bias"):
        SamplingParams(logits_processors=[lambda ids, logits: logits])
    with pytest.raises(ValueError, match="^guided_decoding is vLLM's old name for "
                                         "structured_outputs"):
        SamplingParams(guided_decoding={"json": {}})
    assert SamplingParams(logits_processors=[], skip_clone=True, guided_decoding=None) == \
        SamplingParams()
    assert not {"logits_processors", "guided_decoding", "skip_clone"} & {
        f.name for f in fields(SamplingParams)}  # nothing crosses to the core
