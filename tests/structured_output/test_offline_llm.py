"""Structured outputs offline (LLM.generate with SamplingParams(structured_outputs=...)) on a
tiny random Qwen2 with a byte-level tokenizer: outputs follow their schema / regex / choice,
eagerly and in compile mode 3 (the same tokens), with n > 1 and logprobs of the constrained
distribution (finite for every sampled token, rank 1 for greedy)."""
import json
import math
import re

import pytest

from kiln import LLM, SamplingParams
from kiln.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from kiln.sampling_params import StructuredOutputsParams

from checkpoints import make_tiny_checkpoint

# The engine core in this process: what is tested is the engine, not its process (a core
# process costs an interpreter start per engine; test_core_process.py covers that one).
pytestmark = pytest.mark.usefixtures("inprocess_core")

jsonschema = pytest.importorskip("jsonschema")

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "pattern": "^[a-z]{1,4}$"},
    "level": {"type": "integer", "minimum": 1, "maximum": 5},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    "inner": {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}},
    "required": ["name", "level", "inner"]}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("qwen_chat"), "qwen2", tie=True,
                                tokenizer="chat")


@pytest.fixture(scope="module")
def eager_llm(model_dir):
    """One eager engine for the tests here that need nothing else of it (512 tokens: the chat
    with tools' prompt; a request never changes a later one's answer)."""
    llm = LLM(model=str(model_dir), max_model_len=512, kv_cache_memory=0.02,
              enforce_eager=True)
    yield llm
    llm.shutdown()


def _params(**kw):
    so = StructuredOutputsParams(json=SCHEMA, disable_any_whitespace=True)
    return SamplingParams(max_tokens=120, structured_outputs=so, **kw)


def _run(llm):
    return llm.generate(
        ["alpha", "beta", "gamma", "delta"],
        [_params(temperature=0, logprobs=1), _params(temperature=1.0, seed=3, n=3, logprobs=2),
         SamplingParams(temperature=0.7, max_tokens=12,
                        structured_outputs=StructuredOutputsParams(regex=r"[xy]{2}\d")),
         SamplingParams(temperature=0, max_tokens=12, structured_outputs={
             "choice": ["left", "right", "up"]})], use_tqdm=False)


def _check(outs):
    greedy, sampled, rx, choice = outs
    for o in greedy.outputs + sampled.outputs:
        assert o.finish_reason == "stop", o.text
        jsonschema.validate(json.loads(o.text), SCHEMA)
        assert all(math.isfinite(lp[t].logprob) for t, lp in zip(o.token_ids, o.logprobs))
    assert len(sampled.outputs) == 3
    assert all(lp[t].rank == 1 for t, lp in zip(greedy.outputs[0].token_ids,
                                                greedy.outputs[0].logprobs))
    assert re.fullmatch(r"[xy]{2}\d", rx.outputs[0].text)
    assert choice.outputs[0].text in ("left", "right", "up")


def test_eager_and_mode_3_follow_the_grammar_alike(model_dir, eager_llm):
    eager = _run(eager_llm)
    _check(eager)
    llm = LLM(model=str(model_dir), max_model_len=256, kv_cache_memory=0.02,
              compilation_config={"mode": 3, "backend": "eager"})
    try:
        compiled = _run(llm)
    finally:
        llm.shutdown()
    _check(compiled)
    assert eager[0].outputs[0].token_ids == compiled[0].outputs[0].token_ids


def test_bad_schema_is_refused_before_queueing(eager_llm):
    llm = eager_llm
    with pytest.raises(ValueError, match="structured_outputs.json is not a JSON schema"):
        llm.generate("x", SamplingParams(structured_outputs=StructuredOutputsParams(
            json={"type": "nope"})), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()
    out = llm.generate("x", SamplingParams(max_tokens=2, structured_outputs={
        "regex": "[a-z]{9}"}), use_tqdm=False)[0].outputs[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 2
    # A grammar that reaches a dead end (no token allowed) ends its request there: the
    # sampler drew token 0 outside it, with a NaN logprob, and generation went on
    # unconstrained. Its neighbour in the batch is untouched.
    dead, alive = llm.generate(["x", "x"], [
        SamplingParams(max_tokens=8, logprobs=1, structured_outputs={"regex": "ab[^\\s\\S]"}),
        SamplingParams(max_tokens=3, temperature=0, structured_outputs={"regex": "[a-z]{9}"})],
        use_tqdm=False)
    assert dead.outputs[0].finish_reason == "abort" and dead.outputs[0].text == "ab"
    assert dead.outputs[0].error == ("structured_outputs.regex allows no token after 2 "
                                     "generated token(s); check that the constraint can "
                                     "be satisfied")
    assert alive.outputs[0].error is None
    assert all(math.isfinite(next(iter(lp.values())).logprob)
               for lp in dead.outputs[0].logprobs)
    assert alive.outputs[0].finish_reason == "length"
    assert re.fullmatch("[a-z]+", alive.outputs[0].text) and len(alive.outputs[0].token_ids) == 3


def test_chat_with_tools_renders_them_and_a_forced_call_parses(eager_llm):
    tool = {"type": "function", "function": {"name": "ping", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer"}}}}}
    call = '<tool_call>\n\\{"name": "ping", "arguments": \\{"n": [1-9]\\}\\}\n</tool_call>'
    llm = eager_llm
    messages = [{"role": "user", "content": "ping"}]
    plain, with_tools = (llm.chat(messages, SamplingParams(
        max_tokens=40, temperature=0, structured_outputs={"regex": call}), tools=t,
        use_tqdm=False)[0] for t in (None, [tool]))
    assert len(with_tools.prompt_token_ids) > len(plain.prompt_token_ids)
    assert '"name": "ping"' in llm.get_tokenizer().decode(with_tools.prompt_token_ids)
    _, (parsed,) = HermesToolParser().extract(with_tools.outputs[0].text)
    assert parsed.function.name == "ping" and 1 <= json.loads(
        parsed.function.arguments)["n"] <= 9
    with pytest.raises(ValueError, match="tools must be"):
        llm.chat(messages, tools={"name": "ping"})


def test_a_clients_stop_token_is_text_to_the_grammar_and_stops_where_it_fits(eager_llm):
    """As in vLLM: a stop token id that is not an end token is allowed where its text fits the
    grammar and ends the request there; as a grammar end it was masked until the grammar ended
    (here, with every first token a stop id, the request failed: no token allowed)."""
    llm = eager_llm
    tok = llm.get_tokenizer()
    ids = [tok.encode(c, add_special_tokens=False)[0] for c in "xy"]
    out = llm.generate("alpha", SamplingParams(
        temperature=0, max_tokens=12, stop_token_ids=ids,
        structured_outputs=StructuredOutputsParams(regex=r"[xy]{2}\d")),
        use_tqdm=False)[0].outputs[0]
    assert (out.finish_reason, out.stop_reason in ids, len(out.token_ids)) == ("stop", True, 1)


def test_a_structural_tag_shapes_the_output(eager_llm):
    """vLLM's structural_tag (xgrammar's tag format, its dict and its text): every output is a
    hermes tool call of the schema, ended by the grammar (whitespace bounded: a random model
    may spin it out to the limit)."""
    schema = {"type": "object", "properties": {
        "name": {"const": "ping"},
        "arguments": {"type": "object", "properties": {
            "n": {"type": "integer", "minimum": 1, "maximum": 9}}, "required": ["n"]}},
        "required": ["name", "arguments"]}
    tag = {"type": "structural_tag", "format": {
        "type": "tag", "begin": "<tool_call>\n", "end": "\n</tool_call>",
        "content": {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": 1}}}
    greedy, sampled = eager_llm.generate(["alpha", "beta"], [
        SamplingParams(max_tokens=120, temperature=0, structured_outputs={"structural_tag": tag}),
        SamplingParams(max_tokens=120, temperature=1.0, seed=1, n=2,
                       structured_outputs=StructuredOutputsParams(structural_tag=json.dumps(tag)))],
        use_tqdm=False)
    for out in greedy.outputs + sampled.outputs:
        assert out.finish_reason == "stop", out.text
        _, (call,) = HermesToolParser().extract(out.text)
        assert call.function.name == "ping", out.text
        assert 1 <= json.loads(call.function.arguments)["n"] <= 9
