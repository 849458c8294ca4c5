"""Engine logprobs -> the two OpenAI shapes: legacy completions and chat `content` entries.

JSON has no -inf, so impossible tokens report a large negative number instead.
"""
import math

from kiln.engine.token_bytes import token_bytes
from kiln.entrypoints.openai.response_models import CompletionLogprobs, TokenLogprob, TopLogprob
from kiln.outputs import Logprob

_FLOOR = -9999.0


def _finite(x: float) -> float:
    return _FLOOR if math.isinf(x) or math.isnan(x) else max(float(x), _FLOOR)


def token_id_text(token_id: int) -> str:
    """A token as return_tokens_as_token_ids names it (text that is not valid UTF-8 stays
    identifiable)."""
    return f"token_id:{token_id}"


def token_text(token_id: int, lp: Logprob | None, tokenizer, as_token_ids: bool = False) -> str:
    if as_token_ids or tokenizer is None:  # no tokenizer (skip_tokenizer_init): ids only
        return token_id_text(token_id)
    if lp is not None and lp.decoded_token is not None:
        return lp.decoded_token
    return tokenizer.decode([token_id])


def _sampled(token_id: int, step: dict[int, Logprob]) -> Logprob | None:
    return step.get(token_id)


def _top(step: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    """The k best candidates by rank (ties by logprob); k -1: all of them (logprobs=-1, the
    whole vocabulary; a slice to -1 dropped the least likely token)."""
    ranked = sorted(step.items(), key=lambda kv: (kv[1].rank if kv[1].rank is not None
                                                  else math.inf, -kv[1].logprob))
    return ranked if k < 0 else ranked[:k]


def completion_logprobs(token_ids: list[int], logprobs: list[dict[int, Logprob] | None],
                        tokenizer, num_top: int, text_offset_start: int = 0,
                        as_token_ids: bool = False) -> CompletionLogprobs:
    """Legacy shape: parallel lists; `text_offset` counts characters from `text_offset_start`.
    A None step (an echoed prompt's first token: nothing predicts it) reports null logprobs."""
    out = CompletionLogprobs()
    offset = text_offset_start
    for tid, step in zip(token_ids, logprobs):
        sampled = _sampled(tid, step) if step is not None else None
        text = token_text(tid, sampled, tokenizer, as_token_ids)
        out.tokens.append(text)
        out.token_logprobs.append(None if sampled is None else _finite(sampled.logprob))
        top = None
        if step is not None:
            top = {token_text(cand_id, cand, tokenizer, as_token_ids): _finite(cand.logprob)
                   for cand_id, cand in _top(step, num_top)}
            if sampled is not None:  # OpenAI always lists the sampled token among the candidates
                top.setdefault(text, _finite(sampled.logprob))
        out.top_logprobs.append(top)
        out.text_offset.append(offset)
        offset += len(text)
    return out


def chat_logprobs(token_ids: list[int], logprobs: list[dict[int, Logprob]], tokenizer,
                  num_top: int, as_token_ids: bool = False) -> list[TokenLogprob]:
    entries = []
    for tid, step in zip(token_ids, logprobs):
        sampled = _sampled(tid, step)
        text = token_text(tid, sampled, tokenizer, as_token_ids)
        top = [TopLogprob(token=(t := token_text(cid, c, tokenizer, as_token_ids)),
                          logprob=_finite(c.logprob),
                          bytes=token_bytes(None if as_token_ids else tokenizer, cid, t))
               for cid, c in _top(step, num_top)]
        entries.append(TokenLogprob(
            token=text, logprob=_finite(sampled.logprob) if sampled is not None else _FLOOR,
            bytes=token_bytes(None if as_token_ids else tokenizer, tid, text),
            top_logprobs=top))
    return entries
