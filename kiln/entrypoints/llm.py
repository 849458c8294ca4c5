"""`LLM`: the offline batch API (vLLM's shape): build an engine, generate or chat, get outputs.

Every prompt is validated before any is queued, so a bad prompt leaves the engine untouched.
"""
import itertools
import os
import threading
from collections.abc import Callable, Sequence

from kiln.beam_search import BeamSearchOutput, BeamSearchParams
from kiln.engine.arg_utils import EngineArgs
from kiln.engine.chat_messages import chat_messages, chat_render_kwargs
from kiln.engine.input_processor import PromptType
from kiln.engine.llm_engine import LLMEngine
from kiln.engine.vllm_flags import check_vllm_only_kwargs
from kiln.entrypoints.llm_arguments import refuse_lora, request_priorities, unsupported
from kiln.entrypoints.llm_batches import LLMBatchRunner
from kiln.entrypoints.llm_sleep import LLMSleepMode
from kiln.lora.frontend import per_prompt as lora_per_prompt
from kiln.lora.frontend import with_lora
from kiln.outputs import RequestOutput
from kiln.sampling_params import RequestOutputKind, SamplingParams

_DEFAULT_MAX_NUM_SEQS = EngineArgs.max_num_seqs


_REWARD = ("Kiln's pooling runner embeds, classifies and scores (embed(), classify(), "
           "score()); reward needs a reward head Kiln's models lack")


class LLM(LLMBatchRunner, LLMSleepMode):
    def __init__(self, model: str | None = None, tokenizer: str | None = None, dtype: str = "auto",
                 max_model_len: int | None = None, max_num_seqs: int = _DEFAULT_MAX_NUM_SEQS,
                 max_num_batched_tokens: int | None = None, enforce_eager: bool = False,
                 compilation_config=None, tensor_parallel_size: int = 1, seed: int = 0,
                 load_format: str = "auto", **kwargs):
        # vLLM's arguments with no counterpart here: refused with the reason, or dropped where
        # they ask for nothing (enable_lora=False, hf_overrides={})
        kwargs = check_vllm_only_kwargs(kwargs)
        known = set(EngineArgs.__dataclass_fields__)
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise ValueError(f"unknown LLM argument(s) {unknown}; engine arguments are "
                             f"{sorted(known)}")
        engine_args = EngineArgs(
            model=model, tokenizer=tokenizer, dtype=dtype, max_model_len=max_model_len,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
            enforce_eager=enforce_eager, compilation_config=compilation_config,
            tensor_parallel_size=tensor_parallel_size, seed=seed, load_format=load_format,
            **kwargs)
        self.llm_engine = LLMEngine.from_engine_args(engine_args)
        self._request_counter = itertools.count()
        # One batch runs at a time: a second thread's step loop would take (and drop) the
        # first's outputs, and an in-process core's forward is not re-entrant.
        self._running = threading.Lock()
        self._running_thread: int | None = None  # the thread that holds _running
        self._owner_pid = os.getpid()

    @property
    def model_config(self):
        """vLLM's LLM.model_config (lm-eval and trainers read it): the engine's."""
        return self.llm_engine.model_config

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """SamplingParams with the defaults of the model's generation_config.json (unless
        --generation-config vllm): what generate() uses when given none."""
        return self.llm_engine.get_default_sampling_params()

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool | Callable = True, lora_request=None,
                 priority: list[int] | None = None) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in input order. `lora_request`:
        vLLM's LoRARequest (or one per prompt), with LLM(enable_lora=True). `priority`: one
        int per prompt, lower served first under scheduling_policy="priority" (an n > 1
        prompt's samples share it)."""
        self._check_generate_runner("generate")
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise ValueError("prompts must be a str, a {'prompt_token_ids': [...]} dict or a "
                             f"list of them, got {type(prompts).__name__}")
        prompts = [with_lora(p, lora) for p, lora in
                   zip(prompts, lora_per_prompt(lora_request, len(prompts)))]
        priorities = request_priorities(priority, len(prompts))
        if sampling_params is None:  # the model's generation-config defaults, as vLLM's
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        elif not isinstance(sampling_params, (list, tuple)):
            raise ValueError("sampling_params must be a SamplingParams or a list of them, got "
                             f"{type(sampling_params).__name__}")
        else:
            # a None in the list: that prompt's defaults are the ones None gives the batch
            # (the model's generation config), not a bare SamplingParams()
            defaults = None
            params_list = []
            for params in sampling_params:
                if params is None:
                    defaults = defaults or self.get_default_sampling_params()
                    params = defaults
                params_list.append(params)
            if len(params_list) != len(prompts):
                raise ValueError(f"got {len(params_list)} sampling_params for {len(prompts)} "
                                 "prompts; pass one SamplingParams or one per prompt")
        processed = []
        for i, (prompt, params) in enumerate(zip(prompts, params_list)):
            try:
                item = self.llm_engine.process_inputs(prompt, params)
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
            item.params.output_kind = RequestOutputKind.FINAL_ONLY
            processed.append(item)
        return self._run(processed, use_tqdm, priorities)

    def beam_search(self, prompts, params: BeamSearchParams, lora_request=None,
                    use_tqdm: bool = False,
                    concurrency_limit: int | None = None) -> list[BeamSearchOutput]:
        """vLLM's beam search: per prompt, the best params.beam_width sequences (best first),
        each with its tokens (the prompt's first), text, cum_logprob and per-step logprobs.
        `concurrency_limit`: how many prompts search at once (None: all)."""
        from kiln.entrypoints.beam_search import run_offline

        refuse_lora(lora_request, "beam_search")
        self._check_generate_runner("beam_search")
        return run_offline(self, prompts, params, use_tqdm, concurrency_limit)

    def embed(self, prompts, *, truncate_prompt_tokens: int | None = None,
              use_tqdm: bool | Callable = True, pooling_params=None, lora_request=None):
        """vLLM's: one EmbeddingRequestOutput per prompt (`.outputs.embedding`, a list of
        floats), for an LLM built with runner="pooling" (or task="embed")."""
        from kiln.pooling.offline import embed

        return embed(self, prompts, truncate_prompt_tokens, use_tqdm, pooling_params,
                     lora_request)

    def encode(self, prompts, pooling_params=None, *, truncate_prompt_tokens: int | None = None,
               use_tqdm: bool | Callable = True, lora_request=None,
               pooling_task: str | None = None):
        """vLLM's: one PoolingRequestOutput per prompt (`.outputs.data`, a float32 tensor: the
        embedding, or a classifier's probabilities); pooling_task "embed" or "classify" must
        be the engine's (None: whichever it runs)."""
        from kiln.pooling.offline import run_pooling

        if pooling_task not in ("embed", "classify", None):
            raise ValueError(f"pooling_task {pooling_task!r} is not supported: give \"embed\" "
                             "or \"classify\" (the engine's pooling task)")
        return run_pooling(self, prompts, pooling_params, truncate_prompt_tokens, use_tqdm,
                           lora_request, api=pooling_task)

    def classify(self, prompts, *, truncate_prompt_tokens: int | None = None,
                 use_tqdm: bool | Callable = True, pooling_params=None, lora_request=None):
        """vLLM's: one ClassificationRequestOutput per prompt (`.outputs.probs`), for a
        classification model (a *ForSequenceClassification checkpoint, or convert="classify")."""
        from kiln.pooling.offline import classify

        return classify(self, prompts, truncate_prompt_tokens, use_tqdm, pooling_params,
                        lora_request)

    def score(self, data_1, data_2, /, *, truncate_prompt_tokens: int | None = None,
              use_tqdm: bool | Callable = True, pooling_params=None, lora_request=None,
              chat_template: str | None = None):
        """vLLM's: one ScoringRequestOutput (`.outputs.score`) per (data_1, data_2) pair, 1:1,
        1:N or N:N: a cross-encoder's score (`chat_template` renders "query" and "document"
        messages), or an embedding model's cosine similarity."""
        from kiln.pooling.scoring import score

        return score(self, data_1, data_2, truncate_prompt_tokens, use_tqdm, pooling_params,
                     lora_request, chat_template)

    reward = unsupported("reward", _REWARD)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool | Callable = True, add_generation_prompt: bool = True,
             chat_template: str | None = None, chat_template_kwargs: dict | None = None,
             continue_final_message: bool = False,
             tools: list[dict] | None = None, lora_request=None,
             chat_template_content_format: str = "auto",
             mm_processor_kwargs: dict | None = None) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, via the chat template.
        `continue_final_message`: extend the last message (no end-of-turn after it) instead of
        opening a new assistant turn; it needs add_generation_prompt=False. `tools`: OpenAI
        tool dicts the template renders (as vLLM's LLM.chat); read calls out of the text with
        a tool parser (kiln.entrypoints.openai.tool_parsers)."""
        self._check_generate_runner("chat")
        # vLLM's keywords (a TypeError here): text joined into a string is its "string" format
        if chat_template_content_format not in ("auto", "string"):
            raise ValueError(f"chat_template_content_format {chat_template_content_format!r} "
                             "is not supported: Kiln joins the text parts into a string "
                             "(\"auto\" or \"string\")")
        if mm_processor_kwargs:
            raise ValueError("mm_processor_kwargs is not supported: Kiln's models are text-only")
        if isinstance(messages, str):
            raise ValueError("messages must be a list of {'role', 'content'} dicts (or a list "
                             "of such conversations), got a str; for plain text use generate()")
        if not messages:
            raise ValueError("messages is empty: give a list of {'role', 'content'} dicts")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        kwargs = chat_render_kwargs(add_generation_prompt, continue_final_message, chat_template,
                                    chat_template_kwargs)
        if tools is not None:
            if not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
                raise ValueError("tools must be a list of OpenAI tool dicts ({'type': "
                                 f"'function', 'function': {{...}}}}), got {tools!r}")
            kwargs["tools"] = tools
        prompts = []
        for i, conv in enumerate(conversations):
            if not isinstance(conv, (list, tuple)) or not conv:
                raise ValueError(f"conversation {i} must be a non-empty list of messages, got "
                                 f"{conv!r}")
            try:
                prompts.append(self.llm_engine.chat_prompt(chat_messages(conv), **kwargs))
            except ValueError as e:
                raise ValueError(str(e) if len(conversations) == 1 else f"conversation {i}: {e}") \
                    from None
        return self.generate(prompts, sampling_params, use_tqdm, lora_request=lora_request)

    def _check_generate_runner(self, method: str) -> None:
        model_config = self.llm_engine.model_config
        if model_config.runner_type == "pooling":  # vLLM refuses it too
            from kiln.pooling.pooling_task import generate_fix

            apis = ", ".join(f"{t}()" for t in self.llm_engine.get_supported_tasks())
            raise ValueError(f"LLM.{method}() is only supported for generative models; this "
                             f"LLM runs the pooling runner: use {apis}; or "
                             f"{generate_fix(model_config.architecture, offline=True)}")

    def reset_prefix_cache(self, reset_running_requests: bool = False,
                           reset_connector: bool = False) -> bool:
        """Forget the prefix cache (as vLLM's), e.g. between benchmark runs; waits for a batch
        that another thread runs."""
        self._check_owner()
        # Between batches: a batch's step loop in another thread read (and dropped) this call's
        # answer from the core, which was then waited for forever.
        with self._one_batch("reset_prefix_cache"):
            return self.llm_engine.reset_prefix_cache(reset_running_requests, reset_connector)

    def shutdown(self) -> None:
        self.llm_engine.shutdown()
