"""`LLMBatchRunner`: how LLM runs a batch: one at a time (a lock, a same-thread call refused), in
the process that made it, its requests stepped to the end under a progress bar, or aborted."""
import contextlib
import os
import sys
import threading

from kiln.engine.input_processor import ProcessedPrompt
from kiln.lora.frontend import with_lora_request
from kiln.outputs import RequestOutput


class LLMBatchRunner:
    """Mixed into `LLM` (llm.py): its `llm_engine`, `_request_counter`, `_running`,
    `_running_thread` and `_owner_pid`; beam search and the pooling APIs run through it too."""

    def _check_owner(self) -> None:
        if os.getpid() != self._owner_pid:  # its sockets' other ends are the parent's: a hang
            raise RuntimeError("this LLM was made in the parent of this forked process, whose "
                               "engine it cannot drive; make a new LLM in the child (or fork "
                               "before making one)")

    @contextlib.contextmanager
    def _one_batch(self, method: str):
        """Hold the one-batch lock. A call from inside this thread's own batch (a use_tqdm bar,
        a signal handler) would wait on itself forever: refused instead."""
        if self._running_thread == threading.get_ident():
            raise RuntimeError(f"LLM.{method}() was called from inside this LLM's running "
                               "generate()/chat() on the same thread (e.g. from a use_tqdm bar "
                               "or a signal handler); call it after that batch returns")
        with self._running:
            self._running_thread = threading.get_ident()
            try:
                yield
            finally:
                self._running_thread = None

    def _run(self, processed: list[ProcessedPrompt], use_tqdm,
             priorities: list[int] | None = None) -> list[RequestOutput]:
        self._check_owner()
        with self._one_batch("generate"):
            return self._run_batch(processed, use_tqdm, priorities)

    def _run_batch(self, processed: list[ProcessedPrompt], use_tqdm,
                   priorities: list[int] | None = None) -> list[RequestOutput]:
        from tqdm import tqdm

        # None: every request at priority 0 (beam search's steps call this without any)
        priorities = priorities or [0] * len(processed)
        engine = self.llm_engine
        engine.check_awake("LLM.generate")
        ids = [str(next(self._request_counter)) for _ in processed]
        order = {rid: i for i, rid in enumerate(ids)}
        results: list[RequestOutput | None] = [None] * len(ids)
        pending = set()
        try:
            for rid, item, priority in zip(ids, processed, priorities):
                engine.add_processed_request(rid, item, priority=priority)
                pending.add(rid)
            # vLLM's use_tqdm may be a callable that makes the bar (a tqdm subclass, e.g.
            # tqdm.notebook.tqdm); it is called with tqdm's arguments
            bar_type = use_tqdm if callable(use_tqdm) else tqdm
            with bar_type(total=len(ids), desc="Processed prompts", disable=not use_tqdm,
                          file=sys.stderr, dynamic_ncols=True) as bar:
                while pending:
                    for out in engine.step():
                        if out.finished and out.request_id in pending:
                            results[order[out.request_id]] = with_lora_request(
                                out, processed[order[out.request_id]].lora_request)
                            pending.discard(out.request_id)
                            bar.update(1)
                    if pending and not engine.has_unfinished_requests():
                        raise RuntimeError(f"engine dropped requests {sorted(pending)}")
        finally:
            if pending:
                # Interrupted or failed: do not leave our requests running into the next call.
                engine.abort_request(sorted(pending))
        return results
