"""LLM.chat prompts token for token equal to HF apply_chat_template(tokenize=True), for the
template styles real models use (ChatML, Llama-3 and Llama-2 / Gemma with BOS in the template,
a template refusing system roles), and the server's chat, /tokenize, /detokenize agreeing."""
import pytest

from kiln.entrypoints.llm import LLM
from kiln.sampling_params import SamplingParams

from checkpoints import STORIES_DIR, make_tiny_checkpoint

# Turn markers as added special tokens, as real chat tokenizers have them.
SPECIAL = ["<|im_start|>", "<|im_end|>", "<|start_header_id|>", "<|end_header_id|>",
           "<|eot_id|>", "<start_of_turn>", "<end_of_turn>"]

CHATML = ("{% for m in messages %}{% if loop.first and m['role'] != 'system' %}"
          "<|im_start|>system\nYou are helpful.<|im_end|>\n{% endif %}"
          "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n"
          "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n"
          "{% endif %}{% endif %}")
LLAMA3 = ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}"
          "<|end_header_id|>\n\n{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
          "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n"
          "{% endif %}")
LLAMA2 = ("{% if messages[0]['role'] == 'system' %}{% set sys = messages[0]['content'] %}"
          "{% set rest = messages[1:] %}{% else %}{% set sys = '' %}{% set rest = messages %}"
          "{% endif %}{% for m in rest %}{% if m['role'] == 'user' %}{{ bos_token }}[INST] "
          "{% if loop.first and sys %}<<SYS>>\n{{ sys }}\n<</SYS>>\n\n{% endif %}"
          "{{ m['content'] | trim }} [/INST]{% else %} {{ m['content'] | trim }} {{ eos_token }}"
          "{% endif %}{% endfor %}")
GEMMA = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}"
         "{{ raise_exception('System role not supported') }}{% endif %}<start_of_turn>"
         "{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n{{ m['content'] | trim }}"
         "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n"
         "{% endif %}")
TEMPLATES = {"chatml": CHATML, "llama3": LLAMA3, "llama2": LLAMA2, "gemma": GEMMA}

SYSTEM = {"role": "system", "content": "Be brief."}
CONVERSATIONS = {
    "one": [{"role": "user", "content": "Lily saw a cat"}],
    "multi": [{"role": "user", "content": "Hi there"}, {"role": "assistant", "content": "Hello!"},
              {"role": "user", "content": "Tell a story"}],
    "system": [SYSTEM, {"role": "user", "content": "Hi"}],
}
GREEDY = SamplingParams(temperature=0, max_tokens=2)


def save_tokenizer(path, template: str | None):
    """stories260K's Llama tokenizer (adds BOS on encode) with turn markers and a template."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(STORIES_DIR)
    tok.add_special_tokens({"additional_special_tokens": SPECIAL})
    tok.chat_template = template
    tok.save_pretrained(path)
    return tok


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("chat_ckpt")
    make_tiny_checkpoint(path, "llama", tie=True, vocab_size=600)  # room for SPECIAL
    save_tokenizer(path, CHATML)
    return path


@pytest.fixture(scope="module")
def llm(chat_dir):
    llm = LLM(model=str(chat_dir), enforce_eager=True, max_model_len=256, max_num_seqs=4,
              kv_cache_memory=0.02)
    yield llm
    llm.shutdown()


def hf_ids(llm, messages, template=None, **kw):
    kw.setdefault("add_generation_prompt", True)
    return llm.get_tokenizer().apply_chat_template(messages, chat_template=template,
                                                   return_dict=False, **kw)


def chat_ids(llm, messages, **kw):
    (out,) = llm.chat(messages, GREEDY, use_tqdm=False, **kw)
    assert out.outputs[0].token_ids
    return out.prompt_token_ids


@pytest.mark.parametrize("style", sorted(TEMPLATES))
@pytest.mark.parametrize("conv", sorted(CONVERSATIONS))
@pytest.mark.parametrize("agp", [True, False])
def test_prompt_ids_equal_hf(llm, style, conv, agp):
    messages, template = CONVERSATIONS[conv], TEMPLATES[style]
    if style == "gemma" and conv == "system":
        with pytest.raises(ValueError, match="chat template does not render.*System role"):
            llm.chat(messages, GREEDY, chat_template=template, use_tqdm=False)
        return
    ids = chat_ids(llm, messages, chat_template=template, add_generation_prompt=agp)
    assert ids == hf_ids(llm, messages, template, add_generation_prompt=agp)
    bos = llm.get_tokenizer().bos_token_id
    # BOS where the template writes it (Llama-2: each user turn), never the encoder's extra.
    written = {"chatml": 0, "llama3": 1, "gemma": 1,
               "llama2": sum(m["role"] == "user" for m in messages)}[style]
    assert ids.count(bos) == written
    assert ids[:2].count(bos) == min(written, 1)


@pytest.mark.parametrize("style", sorted(TEMPLATES))
def test_continue_final_message_equals_hf(llm, style):
    messages = [{"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Once upon a"}]
    ids = chat_ids(llm, messages, chat_template=TEMPLATES[style], add_generation_prompt=False,
                   continue_final_message=True)
    assert ids == hf_ids(llm, messages, TEMPLATES[style], add_generation_prompt=False,
                         continue_final_message=True)
    assert llm.get_tokenizer().decode(ids).endswith("Once upon a")  # no end-of-turn after it
    with pytest.raises(ValueError, match="add_generation_prompt=False"):
        llm.chat(messages, GREEDY, continue_final_message=True, use_tqdm=False)


def test_template_kwargs_reach_the_template(llm):
    messages = CONVERSATIONS["one"]
    ids = chat_ids(llm, messages, chat_template_kwargs={"enable_thinking": False})
    assert ids == hf_ids(llm, messages, enable_thinking=False) != hf_ids(llm, messages)
    assert chat_ids(llm, messages, chat_template_kwargs={"add_generation_prompt": False}) == \
        hf_ids(llm, messages, add_generation_prompt=False)


def test_content_parts_null_content_names_and_unknown_roles(llm):
    parts = [{"role": "user", "content": [{"type": "text", "text": "Lily"},
                                          {"type": "text", "text": "saw a cat"}]}]
    assert chat_ids(llm, parts) == hf_ids(llm, [{"role": "user",
                                                 "content": "Lily\nsaw a cat"}])
    for messages in ([{"role": "user", "content": "Hi", "name": "bob"}],
                     [{"role": "tool", "content": "42"}], [{"role": "user", "content": ""}]):
        assert chat_ids(llm, messages) == hf_ids(llm, messages)
    assert chat_ids(llm, [{"role": "user", "content": None}]) == \
        hf_ids(llm, [{"role": "user", "content": ""}])


def test_batch_of_conversations_names_the_bad_one(llm):
    outs = llm.chat([CONVERSATIONS["one"], CONVERSATIONS["multi"]], GREEDY, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [hf_ids(llm, CONVERSATIONS["one"]),
                                                  hf_ids(llm, CONVERSATIONS["multi"])]
    with pytest.raises(ValueError, match=r"conversation 1: .*System role"):
        llm.chat([CONVERSATIONS["one"], CONVERSATIONS["system"]], GREEDY,
                 chat_template=GEMMA, use_tqdm=False)


def test_plain_prompts_match_hf_encode(llm):
    tok = llm.get_tokenizer()
    for text in ("Hello", "<s>Hello", ""):  # BOS once from the encoder, even before "<s>"
        (out,) = llm.generate(text, GREEDY, use_tqdm=False)
        assert out.prompt_token_ids == tok(text).input_ids
    (out,) = llm.generate({"prompt_token_ids": [7, 1, 1, 9]}, GREEDY, use_tqdm=False)
    assert out.prompt_token_ids == [7, 1, 1, 9]


def test_no_chat_template_names_the_flag(chat_dir, tmp_path, monkeypatch):
    # The check is the front end's (before any request): the core in this process spares its
    # process start-up.
    monkeypatch.setenv("KILN_ENABLE_V1_MULTIPROCESSING", "0")
    save_tokenizer(tmp_path, None)
    llm = LLM(model=str(chat_dir), tokenizer=str(tmp_path), enforce_eager=True,
              max_model_len=64, max_num_seqs=2, kv_cache_memory=0.01)
    try:
        with pytest.raises(ValueError, match="no chat template.*--chat-template"):
            llm.chat(CONVERSATIONS["one"], GREEDY, use_tqdm=False)
    finally:
        llm.shutdown()


# ---- the server: the same prompts through /v1/chat/completions and /tokenize ---------------
@pytest.fixture(scope="module")
def client(llm):
    from fastapi.testclient import TestClient

    from kiln.engine.async_llm import AsyncLLM
    from kiln.entrypoints.openai.api_server import ServerSettings, build_app

    app = build_app(AsyncLLM(llm.llm_engine), ServerSettings(served_model_names=["m"]))
    with TestClient(app) as client:
        yield client


SERVER_CASES = [
    (CONVERSATIONS["multi"], {}),
    (CONVERSATIONS["system"], {"add_generation_prompt": False}),
    ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Once"}],
     {"continue_final_message": True, "add_generation_prompt": False}),
    (CONVERSATIONS["one"], {"chat_template_kwargs": {"enable_thinking": False}}),
]


@pytest.mark.parametrize("messages, flags", SERVER_CASES)
def test_server_counts_the_prompt_llm_chat_builds(llm, client, messages, flags):
    expected = chat_ids(llm, messages, **flags)
    chat = client.post("/v1/chat/completions",
                       json=dict(messages=messages, max_tokens=1, **flags)).json()
    assert chat["usage"]["prompt_tokens"] == len(expected)
    tok = client.post("/tokenize", json=dict(messages=messages, **flags)).json()
    assert tok["tokens"] == expected and tok["count"] == len(expected)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
def test_server_refuses_both_generation_flags(client, path):
    body = dict(messages=SERVER_CASES[2][0], max_tokens=1, continue_final_message=True,
                add_generation_prompt=True)
    r = client.post(path, json=body)
    assert r.status_code == 400 and "continue_final_message" in r.text
    # the default add_generation_prompt yields to continue_final_message
    body.pop("add_generation_prompt")
    assert client.post(path, json=body).status_code == 200


def test_tokenize_prompt_and_detokenize_match_hf(llm, client):
    tok = llm.get_tokenizer()
    for text in ("Hello world", "<s>Hi", ""):
        for special in (True, False):
            r = client.post("/tokenize", json=dict(prompt=text, add_special_tokens=special,
                                                   return_token_strs=True)).json()
            ids = tok(text, add_special_tokens=special).input_ids
            assert r["tokens"] == ids and r["token_strs"] == tok.convert_ids_to_tokens(ids)
            back = client.post("/detokenize", json=dict(tokens=ids)).json()["prompt"]
            assert back == tok.decode(ids)
    # messages are counted without extra special tokens unless asked, as in vLLM
    messages = CONVERSATIONS["one"]
    r = client.post("/tokenize", json=dict(messages=messages, add_special_tokens=True)).json()
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert r["tokens"] == tok(text).input_ids == [tok.bos_token_id] + hf_ids(llm, messages)


def test_chat_add_special_tokens_adds_them_on_top_of_the_template(llm, client):
    # vLLM's chat field, default false: the template's own BOS only.
    messages = CONVERSATIONS["one"]
    plain = client.post("/v1/chat/completions", json=dict(messages=messages, max_tokens=1)).json()
    extra = client.post("/v1/chat/completions",
                        json=dict(messages=messages, max_tokens=1, add_special_tokens=True)).json()
    assert plain["usage"]["prompt_tokens"] == len(hf_ids(llm, messages))
    assert extra["usage"]["prompt_tokens"] == len(hf_ids(llm, messages)) + 1
