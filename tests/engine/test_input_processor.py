"""Prompt validation and SamplingParams resolution, before anything reaches the core."""
import pytest

from kiln.config import ModelConfig
from kiln.engine.input_processor import InputProcessor
from kiln.engine.prompt_length import clip_max_tokens
from kiln.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def proc(stories_dir, tokenizer):
    mc = ModelConfig(model=str(stories_dir), max_model_len=64)
    return InputProcessor(mc, tokenizer, extra_eos_token_ids={7})


def test_text_prompt_gets_bos(proc, tokenizer):
    out = proc.process("Hello world", SamplingParams())
    assert out.prompt == "Hello world"
    assert out.prompt_token_ids[0] == tokenizer.bos_token_id
    assert out.prompt_token_ids == tokenizer("Hello world").input_ids


def test_token_and_dict_prompts(proc):
    assert proc.process({"prompt_token_ids": [1, 5, 9]}, None).prompt_token_ids == [1, 5, 9]
    assert proc.process({"prompt": "Hi"}, None).prompt == "Hi"
    with pytest.raises(ValueError, match="prompt_token_ids"):
        proc.process({"text": "x"}, None)
    # llm.generate([504, 3575]) hands each int over as a prompt
    with pytest.raises(ValueError, match=r"got int: token ids go in a dict, \{'prompt_token_ids"):
        proc.process(504, None)


def test_empty_prompt(proc):
    # Empty text is [BOS] for this tokenizer (accepted, as in vLLM): test_chat_inputs.py.
    with pytest.raises(ValueError, match="prompt is empty"):
        proc.process({"prompt_token_ids": []}, None)


def test_too_long_prompt_names_lengths_and_flag(proc):
    with pytest.raises(ValueError, match=r"64.*max_model_len 64.*--max-model-len"):
        proc.process({"prompt_token_ids": [5] * 64}, None)
    assert proc.process({"prompt_token_ids": [5] * 63}, None).params.max_tokens == 1


def test_prompt_larger_than_the_whole_kv_cache(proc):
    """Known at submission: a request that can never be scheduled is refused, not aborted."""
    proc.kv_cache_tokens = 16
    try:
        with pytest.raises(ValueError, match=r"17 is more than the whole KV cache.*16 tokens"):
            proc.process({"prompt_token_ids": [5] * 17}, None)
        assert proc.process({"prompt_token_ids": [5] * 16}, None).params.max_tokens == 16
    finally:
        proc.kv_cache_tokens = None


def test_prompt_larger_than_an_overridden_kv_cache_names_the_override(proc):
    """LLMEngine hands over CacheConfig.larger_cache_flags(): with --num-gpu-blocks-override
    the memory flags change nothing, so the refusal names the override."""
    from kiln.config.cache_config import CacheConfig

    proc.kv_cache_tokens, default = 16, proc.larger_cache_flags
    proc.larger_cache_flags = CacheConfig(num_gpu_blocks_override=1).larger_cache_flags()
    try:
        with pytest.raises(ValueError, match=r"raise --num-gpu-blocks-override \(set to 1\), "
                                             "or shorten the prompt"):
            proc.process({"prompt_token_ids": [5] * 17}, None)
    finally:
        proc.kv_cache_tokens = None
        proc.larger_cache_flags = default


@pytest.mark.parametrize("bad", [512, -1, 10**9])
def test_token_outside_vocab_names_it(proc, bad):
    with pytest.raises(ValueError, match=rf"{bad}.*\[0, 512\)"):
        proc.process({"prompt_token_ids": [1, bad]}, None)


def test_params_are_resolved_on_a_copy(proc, tokenizer):
    user = SamplingParams(max_tokens=None, stop_token_ids=[9])
    out = proc.process({"prompt_token_ids": [1, 2, 3, 4]}, user)
    assert out.params is not user and user.max_tokens is None
    assert out.params.max_tokens == 60  # up to max_model_len
    assert out.params.all_stop_token_ids == {9, tokenizer.eos_token_id, 7}
    # the model's extra end token (7) is a stop token, reported as stop_reason as vLLM does;
    # the tokenizer's eos stays apart (never reported)
    assert out.params.stop_token_ids == [9, 7] and user.stop_token_ids == [9]
    ignore = proc.process({"prompt_token_ids": [1]}, SamplingParams(ignore_eos=True))
    assert ignore.params.all_stop_token_ids == set() and ignore.params.stop_token_ids == []


def test_stop_token_outside_vocab(proc):
    with pytest.raises(ValueError, match="stop_token_ids"):
        proc.process("Hi", SamplingParams(stop_token_ids=[9999]))


def test_clip_max_tokens():
    p = SamplingParams(max_tokens=100, min_tokens=50)
    clip_max_tokens(p, prompt_len=90, max_model_len=120)
    assert (p.max_tokens, p.min_tokens) == (30, 30)
    p = SamplingParams(max_tokens=5)
    clip_max_tokens(p, prompt_len=3, max_model_len=120)
    assert p.max_tokens == 5


def test_max_tokens_past_max_model_len_is_cut_or_refused(proc):
    """LLM.generate cuts it to what fits; the OpenAI server (max_tokens_must_fit) refuses it,
    naming the numbers, as vLLM's does."""
    prompt = {"prompt_token_ids": [5] * 60}
    assert proc.process(prompt, SamplingParams(max_tokens=10)).params.max_tokens == 4
    with pytest.raises(ValueError, match=r"^max_tokens 10 is too large.*60 tokens leave 4 of "
                                         r"max_model_len 64"):
        proc.process(prompt, SamplingParams(max_tokens=10), max_tokens_must_fit=True)
    fits = proc.process(prompt, SamplingParams(max_tokens=None), max_tokens_must_fit=True)
    assert fits.params.max_tokens == 4  # omitted: up to max_model_len


def test_min_tokens_past_max_model_len_is_cut_or_refused(proc):
    """max_tokens omitted defaults to the room left; a min_tokens past it cannot be met: the
    server refuses it (vLLM: 400, min_tokens > max_tokens), LLM.generate cuts it as max_tokens."""
    prompt = {"prompt_token_ids": [5] * 60}
    assert proc.process(prompt, SamplingParams(max_tokens=None, min_tokens=10)).params \
        .min_tokens == 4
    with pytest.raises(ValueError, match=r"^min_tokens 10 is too large.*60 tokens leave 4 of "
                                         r"max_model_len 64; lower min_tokens") as e:
        proc.process(prompt, SamplingParams(max_tokens=None, min_tokens=10),
                     max_tokens_must_fit=True)
    from kiln.entrypoints.openai.serving_engine import add_request_error

    error = add_request_error(e.value, "prompt")  # the server's 400 names the field
    assert (error.param, error.code) == ("min_tokens", "context_length_exceeded")
    fits = proc.process(prompt, SamplingParams(max_tokens=None, min_tokens=4),
                        max_tokens_must_fit=True)
    assert (fits.params.max_tokens, fits.params.min_tokens) == (4, 4)


class CountingTokenizer:
    """The real tokenizer, counting the characters it was asked to encode."""

    def __init__(self, tokenizer):
        self.tokenizer, self.chars = tokenizer, []
        self.eos_token_id = tokenizer.eos_token_id

    def __call__(self, text, **kw):
        self.chars.append(len(text))
        return self.tokenizer(text, **kw)


def test_a_huge_text_prompt_is_refused_from_its_head(stories_dir, tokenizer):
    """Past max_model_len x 16 characters only the head is tokenized: if it alone leaves no
    room the prompt is refused (a 4 MB body costs milliseconds); with truncation it is whole."""
    from kiln.engine.prompt_length import (
        HEAD_CHARS_PER_TOKEN,
        HEAD_MARGIN_TOKENS,
        too_long_for_head,
    )

    counting = CountingTokenizer(tokenizer)
    proc = InputProcessor(ModelConfig(model=str(stories_dir), max_model_len=64), counting)
    head = HEAD_CHARS_PER_TOKEN * (64 + HEAD_MARGIN_TOKENS)
    text = "hello world, " * 20_000  # 260,000 characters
    with pytest.raises(ValueError, match=r"prompt length is more than \d+ tokens.*"
                                         r"max_model_len 64.*--max-model-len"):
        proc.process(text, SamplingParams())
    assert counting.chars == [head]
    counting.chars.clear()
    out = proc.process(text, SamplingParams(truncate_prompt_tokens=8))
    assert counting.chars[0] == len(text) and len(out.prompt_token_ids) == 8
    # The text's BOS stays, before its last 7 tokens (HF's left truncation, vLLM's).
    whole = tokenizer.encode(text)
    assert whole[0] == tokenizer.bos_token_id and out.prompt_token_ids == whole[:1] + whole[-7:]
    # A head that leaves room (long tokens) is no verdict: the whole text is then tokenized.
    assert not too_long_for_head(64 + HEAD_MARGIN_TOKENS - 1, 64)
    assert too_long_for_head(64 + HEAD_MARGIN_TOKENS, 64)


def test_masks_that_leave_no_token_are_refused(proc, tokenizer):
    """Nothing left to sample drew token 0, which none of the masks allowed."""
    eos = tokenizer.eos_token_id
    word = tokenizer.decode([300]).strip()
    one_token = proc.process({"prompt_token_ids": [1, 5]},
                             SamplingParams(bad_words=[word])).params.bad_words_token_ids
    assert [300] in one_token  # the word is the one token 300 here
    with pytest.raises(ValueError, match="allowed_token_ids are all banned by bad_words"):
        proc.process({"prompt_token_ids": [1, 5]},
                     SamplingParams(allowed_token_ids=[300], bad_words=[word]))
    for stops in ([eos], [7], [eos, 7]):  # 7: the model's extra end-of-sequence token
        for ignore_eos in (False, True):  # min_tokens holds eos back under ignore_eos too
            with pytest.raises(ValueError, match="only stop or end tokens, which min_tokens=2"):
                proc.process({"prompt_token_ids": [1, 5]},
                             SamplingParams(allowed_token_ids=stops, min_tokens=2,
                                            ignore_eos=ignore_eos))
    for fine in (SamplingParams(allowed_token_ids=[eos, 300], min_tokens=2),
                 SamplingParams(allowed_token_ids=[eos]),
                 SamplingParams(allowed_token_ids=[300, 301], bad_words=[word])):
        proc.process({"prompt_token_ids": [1, 5]}, fine)


@pytest.mark.parametrize("allowed, words, dead_after", [
    ([5], [[5, 5]], [5]),  # the only token, banned once it was written
    ([5, 6], [[5, 6], [5, 5]], [5]),
    ([5, 6], [[6], [5, 5]], [5]),
    ([5, 6], [[6, 5, 6], [5, 5]], [6, 5]),  # the shorter word ends the longer one's ending
    ([5, 6], [[5, 6], [6, 5]], None),  # each ending leaves the other token
    ([5, 6], [[7, 5], [7, 6]], None),  # 7 is never written, so neither word bans
])
def test_bad_words_of_several_tokens_that_leave_no_token_are_refused(allowed, words, dead_after):
    """A bad word bans its last token after the rest of it: where every allowed token is then
    banned, the sampler had nothing to draw and wrote token 0, outside allowed_token_ids."""
    params = SamplingParams(allowed_token_ids=allowed)
    params.bad_words_token_ids = words
    if dead_after is None:
        params.check_masks_leave_a_token()
        return
    with pytest.raises(ValueError, match=rf"all banned by bad_words once the output ends with "
                                         rf"tokens \[{', '.join(map(str, dead_after))}\]"):
        params.check_masks_leave_a_token()


def test_truncate_to_minus_one_leaves_room_to_generate(proc):
    """-1 kept max_model_len tokens, which the length check then refused: every prompt that
    needed the truncation failed."""
    out = proc.process({"prompt_token_ids": [5] * 100}, SamplingParams(truncate_prompt_tokens=-1))
    assert len(out.prompt_token_ids) == 63 and out.params.max_tokens == 1


def test_truncation_past_the_context_and_ids_that_are_no_integers_say_so(proc):
    """truncate_prompt_tokens 100 of a 64-token context was 'prompt length 100 leaves no room
    ... shorten the prompt', though the user had asked to truncate it; a float or bool id was
    'outside the vocabulary', though 1.0 is inside it (as vLLM refuses both)."""
    with pytest.raises(ValueError, match="truncate_prompt_tokens 100 leaves no room.*at most 63"):
        proc.process({"prompt_token_ids": [5] * 200}, SamplingParams(truncate_prompt_tokens=100))
    for bad in (1.0, True):
        with pytest.raises(ValueError, match=f"token id {bad!r} is a .*token ids are integers"):
            proc.process({"prompt_token_ids": [bad]}, SamplingParams())


@pytest.mark.parametrize("prompt, message", [
    ({"prompt": "hi", "multi_modal_data": {"image": 1}}, "'multi_modal_data' is not supported"),
    ({"prompt": "hi", "mm_processor_kwargs": {}}, "'mm_processor_kwargs' is not supported"),
    ({"prompt": "hi", "promt_token_ids": [1, 2]}, "unknown prompt key 'promt_token_ids'")])
def test_prompt_keys_it_would_ignore_are_refused(proc, prompt, message):
    """They were ignored: an image prompt generated from its text alone."""
    with pytest.raises(ValueError, match=message):
        proc.process(prompt, None)
    proc.process({"prompt": "hi", "cache_salt": "s"}, None)


def test_a_cache_salt_that_is_no_utf8_is_refused_naming_the_field(proc):
    """A lone surrogate (JSON's "\\ud800") passed the check and failed to encode in the core
    client (the server's 400 named the prompt) or, with the core in process, in the scheduler's
    block hashing, failing the step."""
    with pytest.raises(ValueError, match="cache_salt must be valid Unicode"):
        proc.process({"prompt": "hi", "cache_salt": "a\ud800"}, None)
    assert proc.process({"prompt": "hi", "cache_salt": "sel \u00e9\U0001f600"}, None).cache_salt


def test_a_bad_word_with_leading_space_is_banned_as_first_word_too(tmp_path):
    """vLLM encodes a bad word stripped and after a space; " weather" was encoded as given, so
    the unspaced word stayed allowed (helper-41). A byte-level BPE spells the two apart."""
    from transformers import AutoTokenizer

    from kiln.engine.input_processor import bad_words_token_ids
    from kiln.engine.text_encoding import encode_text

    from checkpoints import save_chat_tokenizer

    save_chat_tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    plain = encode_text(tok, "quick", add_special_tokens=False)
    spaced = encode_text(tok, " quick", add_special_tokens=False)
    assert plain != spaced
    for word in (" quick", "\nquick"):
        assert bad_words_token_ids(tok, [word]) == [plain, spaced], word


@pytest.mark.parametrize("name", ["logprobs", "prompt_logprobs"])
def test_logprobs_past_the_vocabulary_refused_under_a_larger_cap(stories_dir, tokenizer, name):
    # --max-logprobs above the vocabulary let logprobs=vocab+1 through to the sampler, whose
    # top-k of more tokens than there are killed the engine core (every request lost).
    mc = ModelConfig(model=str(stories_dir), max_model_len=64, max_logprobs=100_000)
    proc = InputProcessor(mc, tokenizer)
    vocab = mc.vocab_size
    with pytest.raises(ValueError, match=f"{name} must be <= {vocab}, the vocabulary's size"):
        proc.process({"prompt_token_ids": [1, 5]}, SamplingParams(**{name: vocab + 1}))
    assert getattr(proc.process({"prompt_token_ids": [1, 5]},
                                SamplingParams(**{name: vocab})).params, name) == vocab


@pytest.mark.parametrize("name", ["logprobs", "prompt_logprobs"])
def test_logprobs_past_the_vocabulary_blame_it_under_an_unlimited_cap(stories_dir, tokenizer,
                                                                       name):
    # --max-logprobs -1 caps at the vocabulary: "raise --max-logprobs" could not help there
    mc = ModelConfig(model=str(stories_dir), max_model_len=64, max_logprobs=-1)
    proc = InputProcessor(mc, tokenizer)
    with pytest.raises(ValueError, match=f"{name} must be <= {mc.vocab_size}, the vocabulary"):
        proc.process({"prompt_token_ids": [1, 5]}, SamplingParams(**{name: mc.vocab_size + 1}))


def test_bad_words_past_the_models_vocabulary_are_left_out(tmp_path):
    """A tokenizer with more ids than the model's logits (here 512 against 400): a bad word
    spelled with an id past them cannot be written, and banning it indexed past the logits,
    which killed the engine core (every request in flight lost)."""
    import torch
    from transformers import AutoTokenizer

    from kiln.sample.sampler import Sampler
    from kiln.sample.sampling_metadata import build_sampling_metadata

    from checkpoints import make_tiny_checkpoint, save_tiny_tokenizer

    make_tiny_checkpoint(tmp_path, "llama", tie=False, vocab_size=400)
    save_tiny_tokenizer(tmp_path, 512)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    proc = InputProcessor(ModelConfig(model=str(tmp_path), max_model_len=64), tok)
    params = proc.process({"prompt_token_ids": [1, 5]},
                          SamplingParams(bad_words=["w450", "w5 w450", "w7"])).params
    assert params.bad_words_token_ids == [[7]]
    # The sampler leaves such words out too (a request that reached it with them).
    params.bad_words_token_ids = [[450], [5, 450], [7]]
    meta = build_sampling_metadata([params], [[1, 5]], [[5]], [None], None, 400,
                                   torch.device("cpu"))
    assert meta.min_tokens_cols.tolist() == [7]
    assert Sampler()(torch.randn(1, 400), meta).sampled_token_ids.item() != 7


def test_many_bad_words_are_deduplicated_without_comparing_each_to_all(proc, monkeypatch):
    """Each word's ids were looked up in the list of those kept (`ids not in out`): 10,000
    words took 7 s on the front-end thread every short prompt waits on. Counted here as
    comparisons of one word's ids with another's."""
    import kiln.engine.input_processor as ip

    compared = 0

    class Ids(list):
        def __eq__(self, other):
            nonlocal compared
            compared += 1
            return list.__eq__(self, other)

        __hash__ = None

    real = ip.encode_text
    monkeypatch.setattr(ip, "encode_text", lambda *a, **k: Ids(real(*a, **k)))
    words = [f"w{i}" for i in range(2000)] + ["w5"]  # one repeated: kept once
    params = proc.process({"prompt_token_ids": [1, 5]}, SamplingParams(bad_words=words)).params
    assert len({tuple(w) for w in params.bad_words_token_ids}) == \
        len(params.bad_words_token_ids)
    assert compared <= 4 * len(words)
