"""use_beam_search=true on /v1/completions and /v1/chat/completions, as vLLM's server takes it:
beam width n, length_penalty, ignore_eos, max_tokens, temperature and
include_stop_str_in_output. The search (kiln.entrypoints.beam_search) runs its steps as
ordinary requests beside everyone else's; the answer is one RequestOutput per prompt with the
n best sequences, best first, which the handlers turn into choices as any other.

What the search would ignore (vLLM ignores it silently) is refused with a 400 whose message
opens with the field (param use_beam_search): streaming (the answer exists only once the search
ends), logprobs, and every sampling field beyond those above.

A shutdown that aborts a step (as sleep with mode "abort" does) or begins between two steps
ends the search with what it found (200, finish_reason "abort"), as a sampled request in flight
ends; one that begins before the first step's requests reach the engine refuses it (503), as it
refuses a late request.
"""
import math
import secrets

from kiln.beam_search import BeamSearchParams
from kiln.engine.async_llm import AsyncLLM
from kiln.engine.detokenizer import IncrementalDetokenizer
from kiln.entrypoints.beam_search import BeamSearch, step_logprobs, step_params
from kiln.entrypoints.openai.errors import OpenAIError, request_value
from kiln.entrypoints.openai.protocol import RepetitionDetection
from kiln.entrypoints.openai.serving_engine import (
    ServerShuttingDown,
    abort_unfinished,
    add_request_error,
    check_num_sequences,
    merge_streams,
    submit,
)
from kiln.outputs import CompletionOutput, RequestOutput
from kiln.sampling_params import SamplingParams

# Request field -> the values that ask for nothing (the search cannot honour any other).
_UNAPPLIED = {
    "stop": (None, [], ""), "stop_token_ids": (None, []), "min_tokens": (0,),
    "top_p": (None, 1, 1.0), "top_k": (None, 0, -1), "min_p": (None, 0, 0.0),
    "seed": (None,), "presence_penalty": (0, 0.0), "frequency_penalty": (0, 0.0),
    "repetition_penalty": (None, 1, 1.0), "logit_bias": (None, {}),
    "allowed_token_ids": (None, []), "bad_words": (None, []), "prompt_logprobs": (None,),
    "structured_outputs": (None,), "guided_json": (None,), "guided_regex": (None,),
    "guided_choice": (None,), "guided_grammar": (None,), "structural_tag": (None,),
    # repetition detection: the search's steps are one token each, never checked
    "max_repetition_pattern_size": (0,), "min_repetition_pattern_size": (0,),
    "repetition_min_count": (0,), "repetition_detection": (None, RepetitionDetection()),
}


def check_beam_fields(req) -> None:
    """A 400 naming the first field beam search cannot honour; length_penalty without
    use_beam_search too (it scores beams only: vLLM ignores it there)."""
    fields = type(req).model_fields
    if not math.isfinite(getattr(req, "length_penalty", 1.0)):  # JSON's NaN / Infinity
        raise OpenAIError(f"length_penalty must be a finite number, got {req.length_penalty}",
                          param="length_penalty", code="invalid_value")
    if not getattr(req, "use_beam_search", False):
        if getattr(req, "length_penalty", 1.0) != 1.0:
            raise _refused("length_penalty", req.length_penalty,
                           "it scores beam search's sequences only; add use_beam_search=true")
        return
    if req.stream:
        raise _refused("stream", True, "beam search answers once the search ends; omit it")
    if "top_logprobs" in fields and (req.logprobs or req.top_logprobs is not None):  # chat
        raise _refused("logprobs", req.logprobs, "beam search returns no logprobs; omit it")
    if "top_logprobs" not in fields and req.logprobs is not None:
        raise _refused("logprobs", req.logprobs, "beam search returns no logprobs; omit it")
    rf = getattr(req, "response_format", None)
    if rf is not None and rf.type != "text":
        raise _refused("response_format", rf, "beam search follows no grammar; omit it")
    for name, off in _UNAPPLIED.items():
        if name in fields and getattr(req, name) not in off:
            raise _refused(name, getattr(req, name), "beam search does not apply it; omit it")


def _refused(name: str, value, why: str) -> OpenAIError:
    """The message opens with the field; the param is use_beam_search, the switch the field
    conflicts with (a rule across fields that /openapi.json cannot state beside the others)."""
    shown = request_value(value)
    return OpenAIError(f"{name}={shown} is refused with use_beam_search=true: {why}"
                       if name != "length_penalty" else
                       f"length_penalty={shown} is refused: {why}",
                       param="use_beam_search", code="unsupported_parameter")


async def beam_search(llm: AsyncLLM, base_id: str, prompts: list, params: SamplingParams,
                      length_penalty: float, prompt_param: str,
                      renamed: dict[str, str] | None = None,
                      priority: int = 0) -> list[RequestOutput]:
    """Each prompt's n best sequences as one RequestOutput (outputs best first). `params`: the
    request's (n, max_tokens, temperature, ignore_eos, include_stop_str_in_output,
    skip_special_tokens read); max_tokens must fit beside each prompt (400 otherwise)."""
    processor = llm.engine.input_processor
    check_num_sequences(len(prompts), params.n, llm.max_sequences_per_request, prompt_param)
    try:
        sp = step_params(BeamSearchParams(beam_width=params.n, max_tokens=1,
                                          temperature=params.temperature),
                         processor.vocab_size, processor.max_logprobs)
    except ValueError as e:
        # the request's beam width is n
        raise OpenAIError(str(e).replace("beam_width", "n"), param="n",
                          code="invalid_value") from None
    searches, salts = [], []
    for prompt in prompts:  # each checked (and its max_tokens fitted) before any step runs
        first = sp.clone()  # the prompt as sampling reads it: cut to truncate_prompt_tokens
        first.max_tokens = params.max_tokens
        first.truncate_prompt_tokens = params.truncate_prompt_tokens
        try:
            item = await llm.process_inputs(prompt, first, max_tokens_must_fit=True)
        except ValueError as e:
            raise add_request_error(e, prompt_param, renamed) from None
        bp = BeamSearchParams(beam_width=params.n, max_tokens=item.params.max_tokens,
                              ignore_eos=params.ignore_eos, temperature=params.temperature,
                              length_penalty=length_penalty,
                              include_stop_str_in_output=params.include_stop_str_in_output)
        searches.append((BeamSearch(item.prompt_token_ids, bp, processor.eos_token_id,
                                    llm.max_model_len), item.prompt))
        salts.append({} if item.cache_salt is None else {"cache_salt": item.cache_salt})
    step_id = f"{base_id}-beam-{secrets.token_hex(4)}"
    for step in range(max(s.params.max_tokens for s, _ in searches)):
        work = [(i, b) for i, (s, _) in enumerate(searches) for b in s.live()]
        if not work:
            break
        try:
            streams = await submit(llm, f"{step_id}-{step}",
                                   [{"prompt_token_ids": b.tokens, **salts[i]} for i, b in work],
                                   sp, prompt_param, renamed, priority=priority)
        except ServerShuttingDown:
            if step == 0:  # none of its requests reached the engine: refused as a late one
                raise
            # The shutdown began between steps: the answer is what was found so far, as when
            # it aborts a step (below): a sampled request in flight ends the same way.
            for search, _ in searches:
                search.abort()
            break
        try:
            finals: list = [None] * len(work)
            async for k, out in merge_streams(streams):
                finals[k] = out
        finally:  # cancelled (the client left): the step's requests go too
            abort_unfinished(llm, streams)
        if any(out is None or out.outputs[0].finish_reason == "abort" for out in finals):
            for search, _ in searches:  # a step aborted: the answer is what was found so far
                search.abort()
            break
        offered: dict[int, list] = {}
        for k, ((i, _), out) in enumerate(zip(work, finals)):
            offered.setdefault(i, []).append(step_logprobs(out, k))
        for i, candidates in offered.items():
            searches[i][0].advance(candidates)
    return [await _output(llm, base_id, search, text, params) for search, text in searches]


async def _output(llm: AsyncLLM, request_id: str, search: BeamSearch, prompt_text,
                  params: SamplingParams) -> RequestOutput:
    """A search's best sequences as the choices show them: the generated tokens, a final eos
    kept only with include_stop_str_in_output (vLLM's). The text is what sampling the same
    tokens writes (decoded after the prompt, so a word's leading space stays: vLLM's decode
    of the new tokens alone dropped it, "w5 w6" + "w89" under echo)."""
    outputs = []
    for j, beam in enumerate(search.result()):
        tokens = beam.tokens[search.prompt_len:]
        ended_by_eos = beam.finish_reason == "stop"
        shown = tokens if (params.include_stop_str_in_output or not ended_by_eos) \
            else tokens[:-1]
        text = await llm.run_in_engine(_text, llm.tokenizer, search.prompt_token_ids, shown,
                                       params.skip_special_tokens,
                                       params.spaces_between_special_tokens)
        outputs.append(CompletionOutput(index=j, text=text, token_ids=shown,
                                        cumulative_logprob=beam.cum_logprob,
                                        finish_reason=beam.finish_reason,
                                        stop_reason=beam.stop_reason))
    return RequestOutput(request_id=request_id, prompt=prompt_text,
                         prompt_token_ids=search.prompt_token_ids,
                         outputs=outputs, finished=True)


def _text(tokenizer, prompt_token_ids: list[int], token_ids: list[int],
          skip_special_tokens: bool, spaces_between_special_tokens: bool) -> str:
    if tokenizer is None:  # --skip-tokenizer-init: token ids only
        return ""
    detok = IncrementalDetokenizer.for_request(
        tokenizer, prompt_token_ids, skip_special_tokens=skip_special_tokens,
        spaces_between_special_tokens=spaces_between_special_tokens)
    detok.update(token_ids, final=True)
    return detok.output_text
