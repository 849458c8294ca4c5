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
