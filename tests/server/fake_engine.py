"""A test double of LLMEngine for server tests that need no model: deterministic fake tokens.

Token k of a request is (sum(prompt ids) + 7 * k) % vocab, detokenized as "<id> "; one token per
request per step; it honours the DELTA output kind (the only one AsyncLLM asks for).
"""
import contextlib
import threading
import time
from types import SimpleNamespace

from kiln.config import CacheConfig, ParallelConfig
from kiln.engine.engine_token_stats import StepTokens
from kiln.engine.input_processor import (
    ProcessedPrompt,
    check_logprobs_cap,
    prompt_cache_salt,
    validate_prompt_token_ids,
)
from kiln.engine.prompt_length import truncate_prompt
from kiln.outputs import CompletionOutput, Logprob, RequestOutput
from kiln.sampling_params import SamplingParams

VOCAB = 100
EOS = 2


class FakeTokenizer:
    eos_token_id = EOS
    chat_template = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"

    def __call__(self, text, add_special_tokens=True):
        ids = [3 + (ord(c) % (VOCAB - 3)) for c in text]
        return SimpleNamespace(input_ids=([1] if add_special_tokens else []) + ids)

    def decode(self, ids):
        return "".join(f"{i} " for i in ids)

    def convert_ids_to_tokens(self, ids):
        return [f"<{i}>" for i in ids]


class FakeEngine:
    def __init__(self, max_model_len: int = 64, step_delay: float = 0.0):
        self.tokenizer = FakeTokenizer()
        model_config = SimpleNamespace(model="fake-model", max_model_len=max_model_len,
                                       vocab_size=VOCAB, generation_defaults={},
                                       logprobs_cap=20, runner_type="generate")
        self.kiln_config = SimpleNamespace(model_config=model_config,
                                           cache_config=CacheConfig(block_size=16),
                                           parallel_config=ParallelConfig())
        self.step_delay = step_delay
        self.requests: dict[str, dict] = {}
        self.num_total_blocks = 32
        self.num_blocks = self.num_total_blocks
        self.max_model_len = max_model_len
        self.aborted: list[str] = []
        self.shut_down = False
        self.busy = threading.Lock()  # proves no two engine calls overlap
        self.fail_next_step = False
        self.last_steps: list[StepTokens] = []  # as LLMEngine's: one step a call, replica 0

    @contextlib.contextmanager
    def _exclusive(self):
        if not self.busy.acquire(blocking=False):
            raise AssertionError("two engine calls ran at the same time")
        try:
            yield
        finally:
            self.busy.release()

    def add_request(self, request_id, prompt, params: SamplingParams, arrival_time=None, *,
                    max_tokens_must_fit=False, priority=0):
        processed = self.process_inputs(prompt, params, max_tokens_must_fit=max_tokens_must_fit)
        return self.add_processed_request(request_id, processed, arrival_time, priority=priority)

    def process_inputs(self, prompt, params: SamplingParams, *, max_tokens_must_fit=False):
        """Tokenize and check (the front-end thread: it may overlap a step)."""
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer(prompt).input_ids
        elif "prompt_token_ids" not in prompt:  # {"prompt": text, "cache_salt": ...}
            text, ids = prompt["prompt"], self.tokenizer(prompt["prompt"]).input_ids
        else:
            text, ids = prompt.get("prompt"), list(prompt["prompt_token_ids"])
        from_text = not (isinstance(prompt, dict) and "prompt_token_ids" in prompt)
        ids = truncate_prompt(ids, params.truncate_prompt_tokens,  # BOS kept, as the engine
                              self.kiln_config.model_config.max_model_len, int(from_text))
        # The engine's own checks: ids within the vocabulary, room to generate.
        validate_prompt_token_ids(ids, VOCAB, self.kiln_config.model_config.max_model_len)
        check_logprobs_cap(params, self.kiln_config.model_config.logprobs_cap, VOCAB)
        prompt_cache_salt(prompt)
        params.clone().update_from_tokenizer(EOS, VOCAB)  # token-id fields within it
        room = self.kiln_config.model_config.max_model_len - len(ids)
        if max_tokens_must_fit and params.max_tokens is not None and params.max_tokens > room:
            raise ValueError(f"max_tokens {params.max_tokens} is too large: {room} left of "
                             "max_model_len")
        params = params.clone()
        params.max_tokens = min(params.max_tokens or room, room)  # as clip_max_tokens
        return ProcessedPrompt(prompt=text, prompt_token_ids=ids, params=params)

    def add_processed_request(self, request_id, processed, arrival_time=None, *, priority=0):
        # LLMEngine's signature; the fake serves in arrival order (priority is not its subject)
        with self._exclusive():
            if request_id in self.requests:
                raise ValueError(f"request id {request_id!r} is already in use")
            params = processed.params
            self.requests[request_id] = dict(prompt=processed.prompt,
                                             ids=processed.prompt_token_ids, params=params,
                                             k=0, max_tokens=params.max_tokens,
                                             out=[[] for _ in range(params.n)])
        return 0  # the data-parallel replica it went to, as LLMEngine's

    def abort_request(self, request_ids):
        with self._exclusive():
            for rid in request_ids:
                if self.requests.pop(rid, None) is not None:
                    self.aborted.append(rid)

    def _token(self, req, index):
        return (sum(req["ids"]) + 7 * req["k"] + 13 * index) % (VOCAB - 3) + 3

    def step(self):
        with self._exclusive():
            if self.fail_next_step:
                raise RuntimeError("injected engine failure")
            if self.step_delay:
                time.sleep(self.step_delay)
            outputs = []
            tokens = {}
            for rid, req in list(self.requests.items()):
                params = req["params"]
                # Each sample's first token ends its prefill; each sample makes one token.
                tokens[rid] = params.n * ((len(req["ids"]) if req["k"] == 0 else 0) + 1)
                samples = []
                for i in range(params.n):
                    tid = self._token(req, i)
                    text = f"{tid} "
                    finish = None
                    if req["k"] + 1 >= req["max_tokens"]:
                        finish = "length"
                    for s in params.stop:
                        if s in "".join(f"{t} " for t in req["out"][i]) + text:
                            finish, text = "stop", ""
                    if params.stop:  # as the engine holds back what may start a stop string
                        held = req.setdefault("held", [""] * params.n)
                        text, held[i] = (held[i] + text, "") if finish else (held[i], text)
                    req["out"][i].append(tid)
                    lps = None
                    if params.logprobs is not None:
                        lps = [{tid: Logprob(-0.5, 1, f"{tid} "),
                                **{t: Logprob(-1.0 - r, r + 1, f"{t} ")
                                   for r, t in enumerate(range(3, 3 + params.logprobs))
                                   if t != tid}}]
                    samples.append(CompletionOutput(index=i, text=text, token_ids=[tid],
                                                    cumulative_logprob=-0.5 * (req["k"] + 1),
                                                    logprobs=lps, finish_reason=finish))
                prompt_lps = None
                if params.prompt_logprobs is not None and req["k"] == 0:  # once, as the engine
                    prompt_lps = [None] + [{t: Logprob(-0.25, 2, f"{t} ")}
                                           for t in req["ids"][1:]]
                req["k"] += 1
                finished = all(s.finish_reason for s in samples)
                outputs.append(RequestOutput(rid, req["prompt"], req["ids"], samples, finished,
                                             prompt_logprobs=prompt_lps))
                if finished:
                    del self.requests[rid]
            self.last_steps = [StepTokens(0, tokens)] if outputs else []
            return outputs

    def has_unfinished_requests(self):
        return bool(self.requests)

    def step_stats(self):
        return self.get_stats()

    def get_stats(self):
        used = sum(1 for _ in self.requests)
        return dict(num_running=len(self.requests), num_waiting=0,
                    kv_cache_usage=used / self.num_total_blocks,
                    num_free_blocks=self.num_total_blocks - used,
                    num_total_blocks=self.num_total_blocks)

    def apply_chat_template(self, messages, add_generation_prompt=True, **kw):
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment()
        text = env.from_string(self.tokenizer.chat_template).render(messages=messages)
        return text + ("assistant:" if add_generation_prompt else "")

    def chat_prompt(self, messages, add_generation_prompt=True, **kw):
        text = self.apply_chat_template(messages, add_generation_prompt, **kw)
        return {"prompt": text, "prompt_token_ids": self.tokenizer(text, False).input_ids}

    def shutdown(self, timeout=None):
        self.shut_down = True


class RecordingEngine(FakeEngine):
    """Keeps the SamplingParams of the last request it was given (`.params`)."""

    def add_processed_request(self, request_id, processed, arrival_time=None, *, priority=0):
        self.params = processed.params
        return super().add_processed_request(request_id, processed, arrival_time,
                                             priority=priority)


class TextWritingEngine(FakeEngine):
    """Writes `text` as its first token, then stops (max_tokens 1: its one token ends it)."""

    def __init__(self, text: str):
        super().__init__(max_model_len=64)
        self.text = text

    def step(self):
        outputs = super().step()
        for out in outputs:
            for o in out.outputs:
                o.text, o.finish_reason = self.text, o.finish_reason and "stop"
        return outputs
