"""The OpenAI logprob shapes built from engine logprobs (logprob_format.py)."""
from kiln.entrypoints.openai.logprob_format import chat_logprobs, completion_logprobs
from kiln.outputs import Logprob


def _step(vocab: int, sampled: int) -> dict[int, Logprob]:
    """One step's logprobs for the whole vocabulary (logprobs=-1): the sampled token first,
    then every token by rank."""
    step = {sampled: Logprob(logprob=-1.0 - sampled, rank=sampled + 1)}
    step.update({t: Logprob(logprob=-1.0 - t, rank=t + 1) for t in range(vocab)})
    return step


def test_whole_vocabulary_lists_every_token():
    # logprobs=-1 / top_logprobs=-1 reach the formatter as -1: every token, the least likely
    # included (the server listed vocab - 1 of them)
    vocab = 6
    steps = [_step(vocab, 0), _step(vocab, 2)]
    chat = chat_logprobs([0, 2], steps, None, -1)
    assert [len(e.top_logprobs) for e in chat] == [vocab, vocab]
    assert chat[0].top_logprobs[-1].token == f"token_id:{vocab - 1}"
    legacy = completion_logprobs([0, 2], steps, None, -1)
    assert [len(top) for top in legacy.top_logprobs] == [vocab, vocab]
    assert f"token_id:{vocab - 1}" in legacy.top_logprobs[0]


def _joined_bytes(tokenizer, text: str) -> tuple[bytes, list[bytes]]:
    """The chat entries' bytes for `text`'s tokens joined, and each top candidate's bytes."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    steps = [{t: Logprob(logprob=-1.0, rank=1, decoded_token=tokenizer.decode([t]))}
             for t in ids]
    entries = chat_logprobs(ids, steps, tokenizer, 1)
    return (b"".join(bytes(e.bytes) for e in entries),
            [bytes(e.top_logprobs[0].bytes) for e in entries])


def test_bytes_of_tokens_splitting_a_character_join_into_the_text(tmp_path):
    # OpenAI's bytes field exists so that clients can join them into the text where a character
    # spans tokens: each such token's text alone is U+FFFD, whose UTF-8 joined into "\ufffd"s
    from transformers import AutoTokenizer

    from checkpoints import STORIES_DIR, save_chat_tokenizer

    save_chat_tokenizer(tmp_path)
    byte_level = AutoTokenizer.from_pretrained(tmp_path)  # GPT-2 byte-level BPE
    joined, tops = _joined_bytes(byte_level, "日本 café")
    assert joined == "日本 café".encode()
    assert tops[0] == "日".encode()[:1]  # a candidate's bytes are its own too
    fallback = AutoTokenizer.from_pretrained(STORIES_DIR)  # SentencePiece <0xE6> byte tokens
    joined, _ = _joined_bytes(fallback, "日本")
    assert "日本".encode() in joined and "\ufffd".encode() not in joined
    # ids only (return_tokens_as_token_ids): the bytes are those of the "token_id:N" text
    step = {7: Logprob(logprob=-1.0, rank=1)}
    (entry,) = chat_logprobs([7], [step], byte_level, 1, as_token_ids=True)
    assert bytes(entry.bytes) == b"token_id:7"
