"""Stop strings and streamed text through the OutputProcessor on tokenizers built here (no
files, no network): a Llama-style byte-fallback BPE (Metaspace, Strip decoder) and a byte-level
BPE, each with added special and normal tokens carrying lstrip / rstrip / normalized flags.

Reference: the full decode of the output (less the prompt context's own text), cut where the
first-completing stop string ends; every output kind must agree with it and never take back
text it showed.
"""
import random

import pytest

from kiln.core.outputs import EngineCoreOutput
from kiln.engine.output_processor import OutputProcessor
from kiln.sampling_params import RequestOutputKind, SamplingParams
from tests.engine.released_text import released_text

pytestmark = pytest.mark.usefixtures("detokenizer_kind")

FFFD = "\ufffd"


def _byte_fallback_bpe():
    from tokenizers import AddedToken, Tokenizer, decoders, models, normalizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{b:02X}>": 3 + b for b in range(256)}}
    for c in "abcdefghijklmnopqrstuvwxyz▁.,!?日本":
        vocab.setdefault(c, len(vocab))
    merges = [("▁", "t"), ("h", "e"), ("▁t", "he"), ("▁", "a"), ("a", "t"), ("▁", "c"),
              ("▁c", "at"), ("日", "本")]
    for a, b in merges:
        vocab.setdefault(a + b, len(vocab))
    core = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token="<unk>",
                                byte_fallback=True, fuse_unk=True))
    core.normalizer = normalizers.Sequence([normalizers.Prepend("▁"),
                                            normalizers.Replace(" ", "▁")])
    core.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(),
                                      decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>",
                                  unk_token="<unk>", clean_up_tokenization_spaces=False)
    tok.add_special_tokens({"additional_special_tokens": [
        AddedToken("<|im_end|>", lstrip=True, rstrip=True, normalized=False, special=True),
        "<|tool|>"]})
    tok.add_tokens([AddedToken(" hello", normalized=False),
                    AddedToken("<think>", lstrip=True), AddedToken("wörld", rstrip=True)])
    return tok


def _byte_level_bpe():
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    core.train_from_iterator(["the cat sat on the mat 日本語 😀 hello world"] * 50, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|endoftext|>",
                                  clean_up_tokenization_spaces=False)
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tok.add_tokens([AddedToken(" hi there", normalized=False),
                    AddedToken("<tool_call>", lstrip=True, rstrip=True), "ñu"])
    return tok


@pytest.fixture(scope="module", params=["byte_fallback_bpe", "byte_level_bpe"])
def built_tokenizer(request):
    return {"byte_fallback_bpe": _byte_fallback_bpe, "byte_level_bpe": _byte_level_bpe}[
        request.param]()


def _full_text(tok, prompt, ids, skip):
    return released_text(tok, prompt, ids, skip)


def _reference_cut(full, stop, include):
    best = None  # (end, stop): the first to complete, then the longer
    for s in stop:
        j = full.find(s)
        if j != -1 and (best is None or (j + len(s), -len(s)) < (best[0], -len(best[1]))):
            best = (j + len(s), s)
    if best is None:
        return full, None
    return (full[:best[0]] if include else full[:best[0] - len(best[1])]), best[1]


def test_streamed_and_whole_text_match_a_full_decode_cut_at_the_first_stop(built_tokenizer):
    """Some requests end with a stop token (stop_token_ids; not a byte token): its text is
    kept, and searched for stop strings as vLLM does, only with include_stop_str_in_output;
    the text before it is searched either way."""
    tok = built_tokenizer
    vocab = tok.get_vocab()
    byte_tokens = [vocab[f"<0x{b:02X}>"] for b in "€😀日\n".encode() if f"<0x{b:02X}>" in vocab]
    pool = list(byte_tokens)
    pool += list(tok.added_tokens_decoder)
    pool += [i for t, i in vocab.items() if any(ord(c) > 127 for c in t)][:100]
    for seed in range(200):
        rng = random.Random(seed)
        skip, include = rng.random() < 0.5, rng.random() < 0.5
        ids = [rng.choice(pool) if rng.random() < 0.5 else rng.randrange(len(tok))
               for _ in range(rng.randint(1, 20))]
        prompt = [rng.randrange(len(tok)) for _ in range(rng.randint(1, 6))]
        stop_token = None
        if rng.random() < 0.4:
            stop_token = rng.choice([t for t in pool + [rng.randrange(len(tok))]
                                     if t not in byte_tokens])
        full = _full_text(tok, prompt, ids, skip)
        stop = []
        for _ in range(rng.randint(1, 3) if full else 0):
            a = rng.randrange(len(full))
            s = full[a:a + rng.randint(1, 4)]
            if FFFD not in s:
                stop.append(s)
        kind = rng.choice(list(RequestOutputKind))
        proc = OutputProcessor(tok)
        params = SamplingParams(stop=stop or None, include_stop_str_in_output=include,
                                skip_special_tokens=skip, output_kind=kind)
        proc.add_request("r", None, prompt, [("r", params)], kind)
        outs = []
        steps = ids + ([stop_token] if stop_token is not None else [])
        end = ("stop", stop_token) if stop_token is not None else ("length", None)
        for i, t in enumerate(steps):
            last = i == len(steps) - 1
            res = proc.process_outputs([EngineCoreOutput(
                "r", [t], finish_reason=end[0] if last else None,
                stop_reason=end[1] if last else None)])
            outs += res.request_outputs
            if outs and outs[-1].finished:
                break
        if stop_token is not None and include:
            full = _full_text(tok, prompt, ids + [stop_token], skip)
        want, reason = _reference_cut(full, stop, include)
        if reason is None and stop_token is not None:
            reason = stop_token
        texts = [o.outputs[0].text for o in outs]
        if kind == RequestOutputKind.DELTA:
            got = "".join(texts)
        else:
            got = texts[-1]
            assert all(got.startswith(t) for t in texts), (seed, texts)
        last = outs[-1].outputs[0]
        assert outs[-1].finished and (got, last.stop_reason) == (want, reason), (
            seed, stop, include, skip, kind, prompt, ids)
        assert last.finish_reason == ("stop" if reason is not None else "length"), seed
