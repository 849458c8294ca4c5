"""Beam search over the engine, vLLM's way: a front-end loop, not a sampler mode.

Every step each live beam is its own request for one token with the top 2 * beam_width
logprobs (the prefix cache makes the beams' shared prefixes cheap). Each beam's candidates
extend it; those ending in eos (unless ignore_eos) are finished, the best beam_width of the
rest by cumulative logprob live on. After max_tokens steps (or when none lives), the finished
and the live are ranked by vLLM's length-penalized score and the best beam_width returned.
`BeamSearch` is one prompt's search, with no engine; the drivers here (offline) and in
kiln.entrypoints.openai.beam_search (server) run its steps.
"""
from kiln.beam_search import (
    BeamSearchOutput,
    BeamSearchParams,
    BeamSearchSequence,
    create_sort_beams_key_function,
)
from kiln.outputs import Logprob
from kiln.sampling_params import RequestOutputKind, SamplingParams


def step_params(params: BeamSearchParams, vocab_size: int, max_logprobs: int) -> SamplingParams:
    """One step's request: one token, the top 2 * beam_width logprobs (HF's candidate count,
    as vLLM's), at most the vocabulary. Over the engine's --max-logprobs: refused naming
    beam_width (the step's logprobs are not the caller's field)."""
    wanted = min(2 * params.beam_width, vocab_size)
    if wanted > max_logprobs:
        raise ValueError(f"beam_width={params.beam_width} needs the top {wanted} logprobs each "
                         f"step, more than the engine's max_logprobs {max_logprobs}; lower "
                         f"beam_width to {max(max_logprobs // 2, 1)} or start the engine with "
                         f"--max-logprobs {wanted}")
    return SamplingParams(n=1, max_tokens=1, temperature=params.temperature, logprobs=wanted,
                          ignore_eos=True, detokenize=False,
                          output_kind=RequestOutputKind.FINAL_ONLY)


class BeamSearch:
    """One prompt's search state. `live()` gives the beams to extend this step; `advance()`
    takes each one's offered logprobs; `result()` ranks what was found."""

    def __init__(self, prompt_token_ids: list[int], params: BeamSearchParams,
                 eos_token_id: int | None, max_model_len: int):
        self.params = params
        self.eos_token_id = None if params.ignore_eos else eos_token_id
        self.max_model_len = max_model_len
        self.prompt_token_ids = list(prompt_token_ids)
        self.prompt_len = len(prompt_token_ids)
        self.beams = [BeamSearchSequence(tokens=list(prompt_token_ids))]
        self.completed: list[BeamSearchSequence] = []
        self.steps = 0
        self.sort_key = create_sort_beams_key_function(eos_token_id, params.length_penalty)

    def live(self) -> list[BeamSearchSequence]:
        """The beams to extend now: none after max_tokens steps. A beam that fills
        max_model_len can take no token: it ends there ("length"), as a request would."""
        if self.steps >= self.params.max_tokens:
            return []
        full = [b for b in self.beams if len(b.tokens) >= self.max_model_len]
        if full:
            self.completed.extend(full)
            self.beams = [b for b in self.beams if len(b.tokens) < self.max_model_len]
        return self.beams

    def advance(self, offered: list[dict[int, Logprob]]) -> None:
        """Each live beam's candidates (token -> logprob, in live() order) -> the next beams."""
        if len(offered) != len(self.beams):
            raise ValueError(f"got candidates for {len(offered)} beams, {len(self.beams)} live")
        # Only the kept candidates become sequences (each copies its parent's lists): making
        # all 2 * beam_width per beam cost O(length) each, steps of a long search seconds.
        candidates = []  # (sum, beam, its candidates, token)
        for beam, step in zip(self.beams, offered):
            for token, lp in step.items():
                cum = beam.cum_logprob + lp.logprob
                if token == self.eos_token_id:
                    # vLLM's beam search ends it with finish_reason "stop" and the eos id as
                    # stop_reason (a sampled request's eos leaves it None)
                    ended = _extend(beam, step, token, cum, "stop")
                    ended.stop_reason = token
                    self.completed.append(ended)
                else:
                    candidates.append((cum, beam, step, token))
        # Stable: equal sums keep the order the beams and their candidates came in.
        candidates.sort(key=lambda c: c[0], reverse=True)
        self.beams = [_extend(beam, step, token, cum)
                      for cum, beam, step, token in candidates[:self.params.beam_width]]
        self.steps += 1

    def abort(self) -> None:
        """The search ends now (a step was aborted, or the next refused: the server is shutting
        down, the engine went to sleep): the live beams end with finish_reason "abort", as a
        sampled request would, and result() ranks them with the finished."""
        for b in self.beams:
            b.finish_reason = "abort"
        self.steps = self.params.max_tokens

    def result(self) -> list[BeamSearchSequence]:
        """The best beam_width of the finished and the live, best first; live ones (and those
        max_model_len ended) finish by "length"."""
        for b in self.completed + self.beams:
            if b.finish_reason is None:
                b.finish_reason = "length"
        ranked = sorted(self.completed + self.beams, key=self.sort_key, reverse=True)
        return ranked[:self.params.beam_width]


def _extend(beam: BeamSearchSequence, step: dict[int, Logprob], token: int, cum: float,
            finish_reason: str | None = None) -> BeamSearchSequence:
    return BeamSearchSequence(tokens=beam.tokens + [token], logprobs=beam.logprobs + [step],
                              cum_logprob=cum, finish_reason=finish_reason)


def step_logprobs(out, beam_index: int) -> dict[int, Logprob]:
    """The candidates one step's output offers; a request the engine ended itself (its KV cache
    can never hold it) fails the search with the engine's reason."""
    o = out.outputs[0]
    if o.error is not None:
        raise RuntimeError(f"beam {beam_index}'s step failed: {o.error}")
    if not o.logprobs:
        raise RuntimeError(f"beam {beam_index}'s step returned no token "
                           f"(finish_reason {o.finish_reason!r})")
    return o.logprobs[0]


def normalize_prompts(prompts) -> list:
    """vLLM's prompts argument: a list of text or {"prompt"|"prompt_token_ids": ...} prompts
    (one alone is taken as a list of one)."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if not isinstance(prompts, (list, tuple)):
        raise ValueError("prompts must be a str, a {'prompt_token_ids': [...]} dict or a list "
                         f"of them, got {type(prompts).__name__}")
    return list(prompts)


def run_offline(llm, prompts, params: BeamSearchParams, use_tqdm=False,
                concurrency_limit: int | None = None) -> list[BeamSearchOutput]:
    """LLM.beam_search: every prompt's search, `concurrency_limit` prompts at a time (all at
    once when None), each step one batch through the engine."""
    from tqdm import tqdm

    if not isinstance(params, BeamSearchParams):
        raise ValueError("params must be a BeamSearchParams (kiln.sampling_params), got "
                         f"{type(params).__name__}")
    prompts = normalize_prompts(prompts)
    if concurrency_limit is not None and not (
            isinstance(concurrency_limit, int) and not isinstance(concurrency_limit, bool)
            and concurrency_limit >= 1):
        raise ValueError(f"concurrency_limit must be None or an integer >= 1, got "
                         f"{concurrency_limit!r}")
    engine = llm.llm_engine
    processor = engine.input_processor
    sp = step_params(params, processor.vocab_size, processor.max_logprobs)
    # vLLM's offline steps decode what they offer: seq.logprobs[i][token].decoded_token is the
    # token's text there (the server's answer shows no logprobs: its steps skip the decode).
    sp.detokenize = True
    searches, salts = [], []
    for i, prompt in enumerate(prompts):  # every prompt checked before any step runs
        try:
            item = engine.process_inputs(prompt, sp)
        except ValueError as e:
            raise ValueError(f"prompt {i}: {e}") from None
        searches.append(BeamSearch(item.prompt_token_ids, params, processor.eos_token_id,
                                   engine.max_model_len))
        salts.append({} if item.cache_salt is None else {"cache_salt": item.cache_salt})
    limit = concurrency_limit or max(len(searches), 1)
    llm._check_owner()
    with llm._one_batch("beam_search"):
        for start in range(0, len(searches), limit):
            group = list(range(start, min(start + limit, len(searches))))
            steps = tqdm(range(params.max_tokens), desc="Beam search", unit="token",
                         disable=not use_tqdm)
            for _ in steps:
                work = [(i, beam) for i in group for beam in searches[i].live()]
                if not work:
                    break
                batch = [engine.process_inputs({"prompt_token_ids": b.tokens, **salts[i]}, sp)
                         for i, b in work]
                outs = llm._run_batch(batch, use_tqdm=False, priorities=[0] * len(batch))
                offered: dict[int, list] = {i: [] for i in group}
                for k, ((i, _), out) in enumerate(zip(work, outs)):
                    offered[i].append(step_logprobs(out, k))
                for i in group:
                    if searches[i].live():
                        searches[i].advance(offered[i])
    tokenizer = llm.get_tokenizer()
    outputs = []
    for search in searches:
        best = search.result()
        for beam in best:  # vLLM's: the whole sequence's text, the prompt's included
            beam.text = tokenizer.decode(beam.tokens) if tokenizer is not None else None
        outputs.append(BeamSearchOutput(sequences=best))
    return outputs
