"""`StructuredOutputManager`: owned by the scheduler; compiles grammars on a thread pool (a
request waits unscheduled until its grammar is ready), caches them, and fills each step's
token bitmask [num_structured_requests, ceil(vocab / 32)] for the requests that sample."""
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from kiln.logger import init_logger
from kiln.structured_output.request import StructuredOutputRequest
from kiln.structured_output.spec import GrammarSpec, grammar_spec
from kiln.thread_priority import lower_this_thread

logger = init_logger(__name__)

# Compiled grammars kept here (and shared by requests in flight); xgrammar's own cache, bounded
# in bytes (xgrammar_backend.py), keeps more behind it. A grammar over a large vocabulary holds
# megabytes of token masks, so this stays short.
_CACHE_SIZE = 32
GRAMMAR_NICENESS = 10  # added to the compile threads' (xgrammar's own threads inherit it)


class StructuredOutputManager:
    def __init__(self, kiln_config, max_workers: int = 2):
        self.kiln_config = kiln_config
        self.vocab_size = kiln_config.model_config.vocab_size
        self._pool: ThreadPoolExecutor | None = None
        self._max_workers = max_workers
        self._backend = None
        self._backend_lock = threading.Lock()
        self._cache: OrderedDict[GrammarSpec, Future] = OrderedDict()
        self.num_compiles = 0  # grammars compiled (cache misses), for tests and stats

    # ---- compiling -------------------------------------------------------------------------
    def backend(self):
        """The xgrammar backend, built on first use from the model's own tokenizer (in the core
        process, so nothing grammar-shaped crosses from the front end)."""
        with self._backend_lock:
            if self._backend is None:
                from kiln.engine.tokenizer import get_tokenizer
                from kiln.structured_output.xgrammar_backend import XgrammarBackend

                tokenizer = get_tokenizer(self.kiln_config.model_config)
                self._backend = XgrammarBackend(tokenizer, self.vocab_size,
                                                max_threads=self._max_workers)
            return self._backend

    def _compile(self, spec: GrammarSpec):
        self.num_compiles += 1
        return self.backend().compile(spec)

    def _compiled(self, spec: GrammarSpec) -> Future:
        # A failed compile stays cached too: a grammar's failure is a function of its spec, and
        # the n samples of one request (or a client's retries) each compiled it again.
        future = self._cache.get(spec)
        if future is not None:
            self._cache.move_to_end(spec)
            return future
        if self._pool is None:
            # Below the engine's threads: a compile of minutes (50,000 choices, a huge schema)
            # slowed every stream's steps, and cannot be stopped once its request is gone.
            self._pool = ThreadPoolExecutor(self._max_workers, thread_name_prefix="kiln-grammar",
                                            initializer=lower_this_thread,
                                            initargs=(GRAMMAR_NICENESS,))
        future = self._pool.submit(self._compile, spec)
        self._cache[spec] = future
        while len(self._cache) > _CACHE_SIZE:
            self._cache.popitem(last=False)
        return future

    def grammar_init(self, request) -> None:
        """Start compiling the request's grammar; it is scheduled once request.
        structured_output_request.is_ready()."""
        params = request.sampling_params
        spec = grammar_spec(params.structured_outputs)
        # The grammar ends on the request's stop tokens that end text (eos, the model's end
        # tokens); with ignore_eos (none of them), on the tokenizer's, and the request then runs
        # on unconstrained. A client's other stop_token_ids are text to the grammar, as in vLLM:
        # allowed where their text fits, and they stop the request there ("\n" as a stop id
        # under a JSON schema stops at a newline; as a grammar end it was masked mid-output).
        stops = sorted(params.all_stop_token_ids & params.end_token_ids)

        def make_matcher(compiled):
            return self.backend().matcher(compiled, stops)

        marker = params.structured_outputs.reasoning_end
        request.structured_output_request = StructuredOutputRequest(
            spec, self._compiled(spec), make_matcher,
            None if marker is None else (lambda: self.backend().token_ids(marker)))

    # ---- each step -------------------------------------------------------------------------
    def grammar_bitmask(self, requests: list) -> tuple[list[str], np.ndarray | None]:
        """The bitmask rows for `requests` (those that sample this step) whose grammar is
        still active: (their ids in row order, int32 [len(ids), ceil(vocab / 32)])."""
        active = [r for r in requests if r.structured_output_request is not None
                  and r.structured_output_request.active]
        if not active:
            return [], None
        import torch

        width = self.backend().bitmask_width
        bitmask = torch.full((len(active), width), -1, dtype=torch.int32)
        for row, request in enumerate(active):
            request.structured_output_request.fill_bitmask(bitmask, row)
        return [r.request_id for r in active], bitmask.numpy()

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
