"""Every field of the completion and chat request models, on a real tiny engine: each one
changes the response (against the same request without it) or is refused with a 400 naming it.

A field added to the protocol without a probe here fails `test_every_field_has_a_probe`; the
structured-output and tool fields' probes accept a refusal until those features land.
"""
import json
import shutil

import pytest
from fastapi.testclient import TestClient

from kiln.engine.arg_utils import EngineArgs
from kiln.engine.async_llm import AsyncLLM
from kiln.engine.llm_engine import LLMEngine
from kiln.entrypoints.openai.api_server import ServerSettings, build_app
from kiln.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest

# The engine core in this process: what is tested is the engine, not its process (a core
# process costs an interpreter start per engine; test_core_process.py covers that one).
pytestmark = pytest.mark.usefixtures("inprocess_core")

CMPL, CHAT = "/v1/completions", "/v1/chat/completions"
BASE = {CMPL: dict(prompt="w5 w6 w7 w8", max_tokens=6, temperature=0),
        CHAT: dict(messages=[{"role": "user", "content": "w5 w6 w7"}], max_tokens=6,
                   temperature=0)}
# Renders documents and one template variable, so both visibly change the prompt.
TEMPLATE = ("{% for d in documents or [] %}w9 {% endfor %}{% if extra %}w8 {% endif %}"
            "{% if reasoning_effort == 'low' %}w7 {% endif %}"
            "{% if enable_thinking is defined and not enable_thinking %}w6 {% endif %}"
            "{% for m in messages %}w4 {{ m['content'] }} w10 {% endfor %}"
            "{% if add_generation_prompt %}w3{% endif %}")
# Fields whose effect is no part of the response by OpenAI's definition.
NO_OUTPUT_EFFECT = {"user"}  # an end-user id for the provider's abuse monitoring


@pytest.fixture(scope="module")
def client(tiny_llama_dir, tmp_path_factory):
    from tokenizers import Tokenizer, processors

    model = tmp_path_factory.mktemp("fields") / "m"
    shutil.copytree(tiny_llama_dir, model)
    # A BOS the tokenizer adds, so add_special_tokens has something to add.
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    tok.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                       special_tokens=[("<s>", 1)])
    tok.save(str(model / "tokenizer.json"))
    args = EngineArgs(model=str(model), enforce_eager=True, max_model_len=64, block_size=4,
                      chat_template=TEMPLATE)
    llm = AsyncLLM(LLMEngine(args.create_kiln_config()))
    app = build_app(llm, ServerSettings(served_model_names=["m"],
                                        enable_prompt_tokens_details=True))
    with TestClient(app) as c:
        yield c


def post(client, path, **fields):
    r = client.post(path, json={**BASE[path], **fields})
    if fields.get("stream"):
        return r.status_code, r.text
    return r.status_code, r.json()


def comparable(body):
    if not isinstance(body, dict):
        return body
    return {k: v for k, v in body.items() if k not in ("id", "created")}


def ok(client, path, **fields):
    status, body = post(client, path, **fields)
    assert status == 200, body
    return body


def texts(body) -> list[str]:
    return [c.get("text", c.get("message", {}).get("content")) for c in body["choices"]]


def changed(client, path, extra, base=None):
    """The response with `extra` differs from the one without (both on top of `base`)."""
    base = base or {}
    assert comparable(ok(client, path, **{**base, **extra})) != \
        comparable(ok(client, path, **base))


def refused(client, path, extra, field, status_code=400):
    status, body = post(client, path, **extra)
    assert status == status_code and body["error"]["param"] == field, body


def refused_or_changed(client, path, extra, field, base=None):
    base = base or {}
    status, body = post(client, path, **{**base, **extra})
    if status == 400:
        assert body["error"]["param"] == field, body
    else:
        assert status == 200 and comparable(body) != comparable(ok(client, path, **base)), body


def greedy_ids(client, path) -> list[int]:
    body = ok(client, path, **logprobs_of(path, 0), return_tokens_as_token_ids=True)
    lp = body["choices"][0]["logprobs"]
    tokens = lp["tokens"] if path == CMPL else [e["token"] for e in lp["content"]]
    return [int(t.split(":")[1]) for t in tokens]


SAMPLED = dict(temperature=2.0, seed=3)
def probe_min_tokens(c, path):
    first = greedy_ids(c, path)[0]
    base = dict(stop_token_ids=[first])
    assert len(texts(ok(c, path, **base, min_tokens=3))[0].split()) >= 3
    changed(c, path, dict(min_tokens=3), base)


def probe_stop(c, path, include=False):
    word = texts(ok(c, path))[0].split()[1]
    extra = dict(stop=[word], include_stop_str_in_output=include)
    body = ok(c, path, **extra)
    assert body["choices"][0]["finish_reason"] == "stop"
    assert texts(body)[0].endswith(word) == include


def probe_cache_salt(c, path):
    ok(c, path, max_tokens=1)  # fills the prefix cache with the prompt
    assert ok(c, path)["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    salted = ok(c, path, cache_salt="tenant-a")
    assert salted["usage"]["prompt_tokens_details"]["cached_tokens"] == 0


def probe_seed(c, path):
    one, two = ok(c, path, **SAMPLED), ok(c, path, **{**SAMPLED, "seed": 4})
    assert texts(one) != texts(two) and texts(one) == texts(ok(c, path, **SAMPLED))


def probe_filter(name, value):
    """A sampling filter tight enough to leave one token: sampling turns greedy."""
    def probe(c, path):
        assert texts(ok(c, path, **SAMPLED, **{name: value})) == texts(ok(c, path))
        changed(c, path, {name: value}, SAMPLED)
    return probe


def probe_allowed(c, path):
    body = ok(c, path, allowed_token_ids=[11, 12])
    assert set(texts(body)[0].split()) <= {"w11", "w12"}


def probe_repetition(c, path):
    """One allowed token repeats from the start: a pattern of 1 token 3 times ends the answer
    there (vLLM's finish_reason and stop_reason), where max_tokens would end it at 6; a bad
    setting is refused naming its field."""
    base = dict(allowed_token_ids=[11])
    assert ok(c, path, **base)["choices"][0]["finish_reason"] == "length"
    body = ok(c, path, **base, max_repetition_pattern_size=2, repetition_min_count=3)
    choice = body["choices"][0]
    assert (choice["finish_reason"], choice["stop_reason"]) == ("repetition",
                                                                "repetition_detected")
    assert texts(body)[0].split() == ["w11"] * 3 and body["usage"]["completion_tokens"] == 3
    # patterns of 2 and more only: "w11 w11" twice is the first, at 4 tokens
    body = ok(c, path, **base, max_repetition_pattern_size=2, min_repetition_pattern_size=2,
              repetition_min_count=2)
    assert body["usage"]["completion_tokens"] == 4
    refused(c, path, dict(max_repetition_pattern_size=2, repetition_min_count=1),
            "repetition_min_count")
    refused(c, path, dict(max_repetition_pattern_size=2, min_repetition_pattern_size=3,
                          repetition_min_count=2), "min_repetition_pattern_size")
    refused(c, path, dict(repetition_min_count=3), "max_repetition_pattern_size")
    # past what the engine core's 64-bit wire holds: a 400, not a failure handing it over
    refused(c, path, dict(max_repetition_pattern_size=2, repetition_min_count=10 ** 30),
            "repetition_min_count")


def probe_repetition_object(c, path):
    """Current vLLM's repetition_detection object does what the flat fields do (vLLM's names
    inside it); a bad setting is refused naming the field inside it."""
    base = dict(allowed_token_ids=[11])
    body = ok(c, path, **base, repetition_detection={"max_pattern_size": 2, "min_count": 3})
    assert (body["choices"][0]["finish_reason"], body["usage"]["completion_tokens"]) == \
        ("repetition", 3)
    body = ok(c, path, **base, repetition_detection={"max_pattern_size": 2,
                                                     "min_pattern_size": 2, "min_count": 2})
    assert body["usage"]["completion_tokens"] == 4
    refused(c, path, dict(repetition_detection={"max_pattern_size": 2, "min_count": 1}),
            "repetition_detection.min_count")


def probe_reasoning_effort(c, path):
    """The template's reasoning_effort variable (vLLM's), over chat_template_kwargs' own, and
    its enable_thinking: off for "none" unless chat_template_kwargs set it; vLLM's values."""
    changed(c, path, dict(reasoning_effort="low"))
    low = comparable(ok(c, path, reasoning_effort="low"))
    assert comparable(ok(c, path, reasoning_effort="low", chat_template_kwargs={
        "reasoning_effort": "high"})) == low
    assert comparable(ok(c, path, chat_template_kwargs={"reasoning_effort": "low"})) == low
    thinking = comparable(ok(c, path, reasoning_effort="minimal"))
    assert comparable(ok(c, path, reasoning_effort="none")) != thinking
    assert comparable(ok(c, path, reasoning_effort="none", chat_template_kwargs={
        "enable_thinking": True})) == thinking
    for effort in ("medium", "high", "xhigh", "max"):  # OpenAI's, and vLLM's "max"
        assert comparable(ok(c, path, reasoning_effort=effort)) == thinking
    refused(c, path, dict(reasoning_effort="maximum"), "reasoning_effort")


def probe_bad_words(c, path):
    first = texts(ok(c, path))[0].split()[0]
    assert texts(ok(c, path, bad_words=[first]))[0].split()[0] != first


def probe_prompt_logprobs(c, path):
    body = ok(c, path, prompt_logprobs=1)
    entries = body["choices"][0]["prompt_logprobs"] if path == CMPL else body["prompt_logprobs"]
    assert entries[0] is None and all(e for e in entries[1:])


def probe_request_id(c, path):
    assert ok(c, path, request_id="abc123")["id"].endswith("-abc123")


def probe_stream(c, path):
    status, text = post(c, path, stream=True)
    assert status == 200 and text.startswith("data: ") and text.rstrip().endswith("[DONE]")


def probe_stream_options(c, path):
    _, without = post(c, path, stream=True)
    _, with_usage = post(c, path, stream=True, stream_options={"include_usage": True})
    assert '"usage":{' not in without and '"usage":{' in with_usage


def probe_truncate(c, path):
    assert ok(c, path, truncate_prompt_tokens=2)["usage"]["prompt_tokens"] == 2


def probe_echo_chat(c, path):
    messages = [{"role": "user", "content": "w5"}, {"role": "assistant", "content": "w6 w7"}]
    base = dict(messages=messages, add_generation_prompt=False, continue_final_message=True)
    body = ok(c, path, **base, echo=True)
    assert texts(body)[0].startswith("w6 w7")
    changed(c, path, dict(echo=True), base)


def logprobs_of(path, value):
    extra = {"logprobs": value} if path == CMPL else {"logprobs": True, "top_logprobs": value}
    return extra


def probe_special_spacing(c, path):
    base = dict(skip_special_tokens=False, logit_bias={"1": 100})
    changed(c, path, dict(spaces_between_special_tokens=False), base)
    text = texts(ok(c, path, **base, spaces_between_special_tokens=False))[0]
    assert text.strip() == "<s>" * 6, text


def probe_priority(c, p):
    # fcfs (this server's policy) ignores it, as vLLM V1 does; test_priority_server.py runs
    # --scheduling-policy priority. Out of int64 it could not reach the core: a 400.
    assert ok(c, p, priority=-7)["choices"] == ok(c, p)["choices"]
    refused(c, p, dict(priority=2**63), "priority")


PROBES = {
    # An unknown model is a 404 model_not_found, as OpenAI and vLLM answer it.
    "model": lambda c, p: refused(c, p, dict(model="not-served"), "model", 404),
    "prompt": lambda c, p: changed(c, p, dict(prompt="w100 w200 w300")),
    "messages": lambda c, p: changed(c, p, dict(messages=[{"role": "user", "content": "w99"}])),
    "max_tokens": lambda c, p: changed(c, p, dict(max_tokens=2)),
    "max_completion_tokens": lambda c, p: changed(c, p, dict(max_completion_tokens=2)),
    "temperature": lambda c, p: changed(c, p, dict(temperature=2.0, seed=0)),
    "top_p": probe_filter("top_p", 1e-6),
    "top_k": probe_filter("top_k", 1),
    "min_p": probe_filter("min_p", 1.0),
    "seed": probe_seed,
    "n": lambda c, p: changed(c, p, dict(n=2)),
    "stop": probe_stop,
    "include_stop_str_in_output": lambda c, p: probe_stop(c, p, include=True),
    "stop_token_ids": lambda c, p: changed(c, p, dict(stop_token_ids=[greedy_ids(c, p)[1]])),
    "min_tokens": probe_min_tokens,
    "ignore_eos": lambda c, p: changed(c, p, dict(ignore_eos=True), dict(logit_bias={"2": 100})),
    "skip_special_tokens": lambda c, p: changed(c, p, dict(skip_special_tokens=False),
                                                dict(logit_bias={"1": 100})),
    "presence_penalty": lambda c, p: changed(c, p, dict(presence_penalty=2.0),
                                             dict(max_tokens=24)),
    "frequency_penalty": lambda c, p: changed(c, p, dict(frequency_penalty=2.0),
                                              dict(max_tokens=24)),
    "repetition_penalty": lambda c, p: changed(c, p, dict(repetition_penalty=2.0),
                                               dict(max_tokens=24)),
    "logit_bias": lambda c, p: changed(c, p, dict(logit_bias={"42": 100})),
    "allowed_token_ids": probe_allowed,
    # each refused naming it where set wrong; what they do: test_repetition_detection_fields
    "max_repetition_pattern_size": lambda c, p: refused(
        c, p, dict(max_repetition_pattern_size=-1), "max_repetition_pattern_size"),
    "min_repetition_pattern_size": lambda c, p: refused(
        c, p, dict(max_repetition_pattern_size=1, min_repetition_pattern_size=2,
                   repetition_min_count=2), "min_repetition_pattern_size"),
    "repetition_min_count": lambda c, p: refused(
        c, p, dict(max_repetition_pattern_size=1, repetition_min_count=1),
        "repetition_min_count"),
    "repetition_detection": probe_repetition_object,
    "bad_words": probe_bad_words,
    "truncate_prompt_tokens": probe_truncate,
    "prompt_logprobs": probe_prompt_logprobs,
    "logprobs": lambda c, p: changed(c, p, {"logprobs": 1 if p == CMPL else True}),
    "top_logprobs": lambda c, p: changed(c, p, dict(top_logprobs=3), dict(logprobs=True)),
    "return_tokens_as_token_ids": lambda c, p: changed(
        c, p, dict(return_tokens_as_token_ids=True), logprobs_of(p, 1)),
    "echo": lambda c, p: (changed(c, p, dict(echo=True)) if p == CMPL else probe_echo_chat(c, p)),
    "stream": probe_stream,
    "stream_options": probe_stream_options,
    "request_id": probe_request_id,
    "cache_salt": probe_cache_salt,
    "add_special_tokens": lambda c, p: changed(c, p, dict(add_special_tokens=p == CHAT)),
    "add_generation_prompt": lambda c, p: changed(c, p, dict(add_generation_prompt=False)),
    "continue_final_message": lambda c, p: changed(
        c, p, dict(continue_final_message=True, add_generation_prompt=False),
        dict(add_generation_prompt=False)),
    "chat_template_kwargs": lambda c, p: changed(c, p, dict(chat_template_kwargs={"extra": 1})),
    "documents": lambda c, p: changed(c, p, dict(documents=[{"title": "a", "text": "b"}])),
    # Refused: what they ask for does not exist in Kiln.
    "suffix": lambda c, p: refused(c, p, dict(suffix="w9"), "suffix"),
    "prompt_embeds": lambda c, p: refused(c, p, dict(prompt_embeds="AAAA"), "prompt_embeds"),
    "best_of": lambda c, p: (refused(c, p, dict(best_of=3), "best_of"),  # 1 or below n: no
                             refused(c, p, dict(best_of=1, n=2), "best_of")),
    "use_beam_search": lambda c, p: changed(c, p, dict(use_beam_search=True), dict(n=2)),
    # scores beam search's sequences only (tests/server/test_beam_search_server.py)
    "length_penalty": lambda c, p: refused(c, p, dict(length_penalty=0.5), "use_beam_search"),
    # <s> x 6 written "<s><s>...", not "<s> <s> ..." (the word tokenizer's decoder spaces them)
    "spaces_between_special_tokens": lambda c, p: probe_special_spacing(c, p),
    "priority": probe_priority,
    "logits_processors": lambda c, p: refused(c, p, dict(logits_processors=["m.P"]),
                                              "logits_processors"),
    "kv_transfer_params": lambda c, p: refused(c, p, dict(kv_transfer_params={"a": 1}),
                                               "kv_transfer_params"),
    "vllm_xargs": lambda c, p: refused(c, p, dict(vllm_xargs={"a": 1}), "vllm_xargs"),
    "chat_template": lambda c, p: refused(c, p, dict(chat_template="{{ 1 }}"), "chat_template"),
    "mm_processor_kwargs": lambda c, p: refused(c, p, dict(mm_processor_kwargs={"a": 1}),
                                                "mm_processor_kwargs"),
    **{name: (lambda c, p, name=name, value=value: refused(c, p, {name: value}, name))
       for name, value in [("guided_whitespace_pattern", " *"),
                           ("logprob_token_ids", [1]),
                           ("thinking_token_budget", 10), ("truncation_side", "right"),
                           ("functions", [{"name": "f"}]), ("function_call", "auto"),
                           ("audio", {"voice": "alloy"}), ("modalities", ["audio"])]},
    # Structured outputs: a grammar changes the output (this word-level vocabulary spells
    # only its words, so a one-word choice); a schema this vocabulary cannot spell is probed
    # by refusing a broken one, naming the field. Tools: read (auto needs the server's flags).
    "structured_outputs": lambda c, p: changed(c, p, dict(structured_outputs={
        "choice": ["w9"]})),
    "guided_choice": lambda c, p: changed(c, p, dict(guided_choice=["w9"])),
    "guided_regex": lambda c, p: changed(c, p, dict(guided_regex="w9")),
    "guided_grammar": lambda c, p: changed(c, p, dict(guided_grammar='root ::= "w9"')),
    "structural_tag": lambda c, p: changed(c, p, dict(structural_tag=json.dumps({
        "type": "structural_tag", "format": {"type": "const_string", "value": "w9"}}))),
    "guided_json": lambda c, p: refused(c, p, dict(guided_json={"type": "nope"}), "guided_json"),
    "response_format": lambda c, p: refused(c, p, dict(response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}),
        "response_format"),
    "tools": lambda c, p: refused(c, p, dict(tools=[{"type": "function", "function": {
        "name": "f", "parameters": {"type": "object"}}}]), "tool_choice"),
    "tool_choice": lambda c, p: refused(c, p, dict(tool_choice="required"), "tool_choice"),
    "parallel_tool_calls": lambda c, p: refused(c, p, dict(parallel_tool_calls=False),
                                                "parallel_tool_calls"),
    "reasoning_effort": probe_reasoning_effort,
    "include_reasoning": lambda c, p: refused_or_changed(c, p, dict(include_reasoning=False),
                                                         "include_reasoning"),
}

FIELDS = sorted({(CMPL, f) for f in CompletionRequest.model_fields}
                | {(CHAT, f) for f in ChatCompletionRequest.model_fields})


def test_every_field_has_a_probe():
    missing = sorted(f for _, f in FIELDS if f not in PROBES and f not in NO_OUTPUT_EFFECT)
    assert not missing, f"request fields with no probe (add one to PROBES): {missing}"


@pytest.mark.parametrize("path,field", [pf for pf in FIELDS if pf[1] not in NO_OUTPUT_EFFECT],
                         ids=lambda v: v.strip("/").replace("/", "_") if "/" in v else v)
def test_field_changes_the_response_or_is_refused(client, path, field):
    PROBES[field](client, path)


@pytest.mark.parametrize("path", [CMPL, CHAT])
def test_repetition_detection_fields(client, path):
    """vLLM's max/min_repetition_pattern_size and repetition_min_count (ignored before)."""
    probe_repetition(client, path)


def test_logit_bias_outside_the_vocabulary_names_the_field(client):
    refused(client, CMPL, dict(logit_bias={"100000": 5}), "logit_bias")
    refused(client, CMPL, dict(allowed_token_ids=[100000]), "allowed_token_ids")
    refused(client, CMPL, dict(logit_bias={"w5": 5}), "logit_bias")
    assert json.dumps(ok(client, CMPL, max_tokens=1)["usage"]).count("cached_tokens") == 1


def probe_return_token_ids(c, path):
    body = ok(c, path, return_token_ids=True, logit_bias={"42": 100})
    choice = body["choices"][0]
    assert choice["token_ids"] == [42] * 6
    prompt_ids = choice["prompt_token_ids"] if path == CMPL else body["prompt_token_ids"]
    assert len(prompt_ids) == body["usage"]["prompt_tokens"]
    _, text = post(c, path, stream=True, return_token_ids=True, logit_bias={"42": 100})
    chunks = [json.loads(line[6:]) for line in text.splitlines()
              if line.startswith("data: {")]
    streamed = [t for ch in chunks for choice in ch["choices"] for t in choice.get("token_ids")
                or []]
    assert streamed == [42] * 6
    assert sum(1 for ch in chunks for holder in [ch, *ch["choices"]]
               if holder.get("prompt_token_ids")) == 1


PROBES["return_token_ids"] = probe_return_token_ids


def test_server_without_a_tokenizer_takes_and_gives_token_ids(tiny_llama_dir):
    args = EngineArgs(model=str(tiny_llama_dir), enforce_eager=True, max_model_len=64,
                      skip_tokenizer_init=True)
    llm = AsyncLLM(LLMEngine(args.create_kiln_config()))
    with TestClient(build_app(llm, ServerSettings(served_model_names=["m"]))) as c:
        body = dict(prompt=[5, 6, 7], max_tokens=3, temperature=0, return_token_ids=True,
                    logprobs=1)
        r = c.post(CMPL, json=body)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["text"] == "" and len(choice["token_ids"]) == 3
        assert choice["prompt_token_ids"] == [5, 6, 7]
        assert all(t.startswith("token_id:") for t in choice["logprobs"]["tokens"])
        for path, fields, param in [
                (CMPL, dict(prompt="w5 w6"), "prompt"),
                (CMPL, dict(prompt=[5, 6], echo=True), "echo"),
                (CHAT, dict(messages=[{"role": "user", "content": "w5"}]), "messages"),
                ("/tokenize", dict(prompt="w5"), "prompt"),
                ("/detokenize", dict(tokens=[5]), "tokens")]:
            r = c.post(path, json=fields)
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (path, r.text)


def test_generation_config_defaults_fill_what_requests_leave_unset(tiny_llama_dir, tmp_path):
    model = tmp_path / "m"
    shutil.copytree(tiny_llama_dir, model)
    (model / "generation_config.json").write_text(json.dumps(
        {"max_new_tokens": 2, "temperature": 0.0}))
    args = EngineArgs(model=str(model), enforce_eager=True, max_model_len=64)
    llm = AsyncLLM(LLMEngine(args.create_kiln_config()))
    with TestClient(build_app(llm, ServerSettings(served_model_names=["m"]))) as c:
        def tokens(path, **fields):
            r = c.post(path, json=fields)
            assert r.status_code == 200, r.text
            return r.json()["usage"]["completion_tokens"], texts(r.json())

        prompt = dict(prompt="w5 w6", ignore_eos=True)
        n, greedy = tokens(CMPL, **prompt)
        assert n == 2  # max_new_tokens caps the request's 16
        assert tokens(CMPL, **prompt, max_tokens=1)[0] == 1  # a smaller request wins
        assert tokens(CMPL, **prompt, seed=0)[1] == greedy  # the model's temperature 0
        assert tokens(CMPL, **prompt, seed=0, temperature=2.0, max_tokens=2)[1] != greedy
        chat = dict(messages=[{"role": "user", "content": "w5"}], ignore_eos=True)
        assert tokens(CHAT, **chat)[0] == 2


def test_completions_max_tokens_null_runs_to_the_context_end(client):
    """vLLM's reading: null is up to max_model_len (64 here), where an absent max_tokens is 16."""
    def usage(**fields):
        body = {k: v for k, v in {**BASE[CMPL], **fields}.items() if v is not ...}
        r = client.post(CMPL, json=body)
        assert r.status_code == 200, r.text
        return r.json()["usage"]

    null = usage(max_tokens=None, ignore_eos=True)
    assert null["prompt_tokens"] + null["completion_tokens"] == 64
    assert usage(max_tokens=..., ignore_eos=True)["completion_tokens"] == 16


def test_echo_of_a_truncated_prompt_is_the_text_of_its_kept_tokens(client):
    """The echo of a prompt truncate_prompt_tokens cut is the text of the tokens the model
    read (BOS and the last 3), which its logprobs tokens describe, not the prompt as sent."""
    body = ok(client, CMPL, prompt="w1 w2 w3 w4 w5 w6 w7 w8 w9", max_tokens=2,
              truncate_prompt_tokens=4, echo=True, logprobs=0)
    (choice,) = body["choices"]
    tokens = choice["logprobs"]["tokens"]
    assert body["usage"]["prompt_tokens"] == 4 and len(tokens) == 4 + 2
    assert choice["text"].startswith("<s> w7 w8 w9 ")
    assert choice["text"] == "".join(tokens)
    offsets = choice["logprobs"]["text_offset"]
    assert offsets == [sum(map(len, tokens[:k])) for k in range(len(tokens))]
    # One as long as truncation keeps, but not cut, echoes the text sent (helper-54: it came
    # back decoded, "<s> " first).
    body = ok(client, CMPL, prompt="w1 w2 w3", max_tokens=1, truncate_prompt_tokens=4,
              echo=True)
    assert body["usage"]["prompt_tokens"] == 4
    assert body["choices"][0]["text"].startswith("w1 w2 w3")
