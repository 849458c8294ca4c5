"""skip_tokenizer_init (ids in, ids out, text refused), --generation-config defaults for unset
fields, and --chat-template replacing the tokenizer's template."""
import json
import shutil

import pytest

from kiln import LLM, SamplingParams
from kiln.config.generation_defaults import default_max_tokens, load_generation_defaults

# All of this is the front end's; the core in this process saves a core start-up per engine.
# The same flags through a core process: test_request_fields.py's server tests (no tokenizer,
# --generation-config defaults).
pytestmark = pytest.mark.usefixtures("inprocess_core")

PROMPT = {"prompt_token_ids": [5, 6, 7, 8, 9]}


@pytest.fixture(scope="module")
def llm_no_tokenizer(tiny_llama_dir):
    llm = LLM(model=str(tiny_llama_dir), enforce_eager=True, max_model_len=64,
              skip_tokenizer_init=True)
    yield llm
    llm.shutdown()


def test_skip_tokenizer_init_takes_and_gives_token_ids(llm_no_tokenizer, tiny_llama_dir):
    assert llm_no_tokenizer.get_tokenizer() is None
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, logprobs=2)
    (out,) = llm_no_tokenizer.generate(PROMPT, params, use_tqdm=False)
    o = out.outputs[0]
    assert len(o.token_ids) == 5 and o.text == ""
    assert all(lp.decoded_token is None for step in o.logprobs for lp in step.values())
    with_tok = LLM(model=str(tiny_llama_dir), enforce_eager=True, max_model_len=64)
    try:
        (want,) = with_tok.generate(PROMPT, params, use_tqdm=False)
    finally:
        with_tok.shutdown()
    assert o.token_ids == want.outputs[0].token_ids


def test_skip_tokenizer_init_refuses_text_and_stops_at_the_config_eos(llm_no_tokenizer):
    with pytest.raises(ValueError, match="skip_tokenizer_init"):
        llm_no_tokenizer.generate("w5 w6", use_tqdm=False)
    with pytest.raises(ValueError, match="skip_tokenizer_init"):
        llm_no_tokenizer.chat([{"role": "user", "content": "hi"}], use_tqdm=False)
    engine = llm_no_tokenizer.llm_engine
    # Stop strings are looked for in the text, which this engine never writes: they were
    # accepted and ignored (the request ran to max_tokens).
    with pytest.raises(ValueError, match="stop strings.*skip_tokenizer_init.*stop_token_ids"):
        engine.process_inputs(PROMPT, SamplingParams(stop=["w7"]))
    processed = engine.process_inputs(PROMPT, SamplingParams())
    assert 2 in processed.params.all_stop_token_ids  # eos of the model config (no tokenizer)


def test_generation_config_defaults_fill_only_unset_fields(tmp_path, tiny_llama_dir):
    model = tmp_path / "m"
    shutil.copytree(tiny_llama_dir, model)
    (model / "generation_config.json").write_text(json.dumps(
        {"temperature": 0.0, "top_k": 7, "max_new_tokens": 3, "do_sample": True}))
    assert load_generation_defaults("auto", model) == {"temperature": 0.0, "top_k": 7,
                                                       "max_tokens": 3}
    assert load_generation_defaults("vllm", model) == {}
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"top_p": 0.5}))
    assert load_generation_defaults(str(other), model) == {"top_p": 0.5}
    with pytest.raises(FileNotFoundError, match="--generation-config"):
        load_generation_defaults(str(tmp_path / "none"), model)
    assert default_max_tokens(None, {"max_tokens": 3}) == 3
    assert default_max_tokens(10, {"max_tokens": 3}) == 3
    assert default_max_tokens(2, {"max_tokens": 3}) == 2
    assert default_max_tokens(5, {}) == 5

    llm = LLM(model=str(model), enforce_eager=True, max_model_len=64)
    try:
        defaults = llm.get_default_sampling_params()
        assert (defaults.temperature, defaults.top_k, defaults.max_tokens) == (0.0, 7, 3)
        (out,) = llm.generate(PROMPT, use_tqdm=False)  # no params: the model's defaults
        assert len(out.outputs[0].token_ids) <= 3
        # a None in a per-prompt list asks for the same defaults (it got a bare
        # SamplingParams(): temperature 1, 16 tokens)
        mixed = llm.generate([PROMPT, PROMPT], [None, SamplingParams(max_tokens=1)],
                             use_tqdm=False)
        assert mixed[0].outputs[0].token_ids == out.outputs[0].token_ids
        assert len(mixed[1].outputs[0].token_ids) == 1
    finally:
        llm.shutdown()
    llm = LLM(model=str(model), enforce_eager=True, max_model_len=64, generation_config="vllm")
    try:
        assert llm.get_default_sampling_params().max_tokens == SamplingParams().max_tokens
    finally:
        llm.shutdown()


def test_config_eos_ends_sequences_without_a_generation_config(tmp_path, tiny_llama_dir):
    """A checkpoint without generation_config.json ends sequences at config.json's eos ids, as
    HF generate and vLLM (GenerationConfig.from_model_config) do: Kiln ran past one that is
    not the tokenizer's eos; with the file, its eos ids are the ones."""
    model = tmp_path / "m"
    shutil.copytree(tiny_llama_dir, model)
    (model / "generation_config.json").unlink()
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "eos_token_id": [2, 300]}))
    llm = LLM(model=str(model), enforce_eager=True, max_model_len=64)
    try:
        stops = llm.llm_engine.process_inputs(PROMPT, SamplingParams()).params
        assert 300 in stops.all_stop_token_ids
    finally:
        llm.shutdown()
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": 2}))
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 301]}))
    # --generation-config DIR names the end tokens too, as in vLLM (they came from the model's)
    for source, stop in ((None, None), (str(other), 301)):
        kw = {} if source is None else {"generation_config": source}
        llm = LLM(model=str(model), enforce_eager=True, max_model_len=64, **kw)
        try:
            stops = llm.llm_engine.process_inputs(PROMPT, SamplingParams()).params
            assert 300 not in stops.all_stop_token_ids
            assert stop is None or stop in stops.all_stop_token_ids
        finally:
            llm.shutdown()


def test_chat_template_flag_replaces_the_tokenizers(tmp_path, tiny_llama_dir):
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}[{{ m['content'] }}]{% endfor %}")
    llm = LLM(model=str(tiny_llama_dir), enforce_eager=True, max_model_len=64,
              chat_template=str(template))
    try:
        prompt = llm.llm_engine.chat_prompt([{"role": "user", "content": "w5"}])
        assert prompt["prompt"] == "[w5]"
    finally:
        llm.shutdown()
    with pytest.raises(FileNotFoundError, match="--chat-template"):
        LLM(model=str(tiny_llama_dir), enforce_eager=True, chat_template="missing.jinja")
