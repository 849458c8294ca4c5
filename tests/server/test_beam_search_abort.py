"""A beam search whose step is aborted (the server's shutdown after its grace period, sleep
with mode "abort") answers what it found with finish_reason "abort", as a sampled request does:
the aborted step's output, with no token to offer, was a 500. So does one whose shutdown begins
between two steps (the next step's refusal was a 503); before its first step it is refused."""
import threading
import time
from types import SimpleNamespace

import pytest
from fastapi.testclient import TestClient

from kiln.engine.async_llm import AsyncLLM
from kiln.entrypoints.openai.api_server import ServerSettings, build_app

from .fake_engine import EOS, VOCAB, FakeEngine


class _HeldEngine(FakeEngine):
    """From its third step on, a step with requests waits for `go`; `held` says one waits."""

    def __init__(self):
        super().__init__(max_model_len=64)
        self.input_processor = SimpleNamespace(vocab_size=VOCAB, max_logprobs=20,
                                               eos_token_id=EOS)  # what beam search reads
        self.tokenizer = None  # token ids in and out (its text needs a real tokenizer)
        self.go, self.held = threading.Event(), threading.Event()
        self.steps = 0

    def step(self):
        self.steps += 1
        if self.steps >= 3 and self.requests:
            self.held.set()
            self.go.wait()
        return super().step()


def _start_search(client):
    """A beam search posted from its own thread: (the thread, the list its answer lands in)."""
    answers = []
    body = dict(prompt=[5, 6], use_beam_search=True, n=2, max_tokens=40, ignore_eos=True,
                return_token_ids=True)
    search = threading.Thread(target=lambda: answers.append(
        client.post("/v1/completions", json=body)))
    search.start()
    return search, answers


def test_an_aborted_beam_search_answers_abort_not_500():
    engine = _HeldEngine()
    llm = AsyncLLM(engine)
    with TestClient(build_app(llm, ServerSettings()), raise_server_exceptions=False) as c:
        search, answers = _start_search(c)
        engine.held.wait()
        # The streams end as aborted at once; the abort itself waits for the held step.
        aborting = c.portal.start_task_soon(llm.abort_all, "the server is shutting down")
        while llm.num_in_flight:
            time.sleep(0.001)
        engine.go.set()
        aborting.result()
        search.join()
    r = answers[0]
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert len(choices) == 2 and {ch["finish_reason"] for ch in choices} == {"abort"}
    # what the steps before the held one found
    assert len({len(ch["token_ids"]) for ch in choices}) == 1 and choices[0]["token_ids"]


class _HeldReadEngine(FakeEngine):
    """Its `hold_at`-th prompt read (the front-end thread) waits for `go`; `reading` says one
    waits. Reads of a beam search of n=2: 1 its prompt, 2 step 0's beam, 3-4 step 1's, 5-6
    step 2's."""

    def __init__(self, hold_at: int):
        super().__init__(max_model_len=64)
        self.input_processor = SimpleNamespace(vocab_size=VOCAB, max_logprobs=20,
                                               eos_token_id=EOS)
        self.tokenizer = None
        self.hold_at, self.reads = hold_at, 0
        self.go, self.reading = threading.Event(), threading.Event()

    def process_inputs(self, prompt, params, **kwargs):
        self.reads += 1
        if self.reads == self.hold_at:
            self.reading.set()
            self.go.wait()
        return super().process_inputs(prompt, params, **kwargs)


@pytest.mark.parametrize("hold_at, steps_done", [(5, 2), (2, 0)])
def test_a_shutdown_between_steps_answers_what_was_found(hold_at, steps_done):
    """The shutdown begins while the next step's prompts are read, no request in flight: after
    two steps the answer is their beams with finish_reason "abort" (200), as a step's abort
    gives; before the first, the search is refused as any request arriving then (503)."""
    engine = _HeldReadEngine(hold_at)
    llm = AsyncLLM(engine)
    with TestClient(build_app(llm, ServerSettings()), raise_server_exceptions=False) as c:
        search, answers = _start_search(c)
        engine.reading.wait()
        assert c.portal.call(llm.abort_all, "the server is shutting down") == 0  # between
        engine.go.set()
        search.join()
    r = answers[0]
    if steps_done == 0:
        assert r.status_code == 503, r.text
        assert r.json()["error"]["code"] == "server_shutting_down"
        return
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert len(choices) == 2 and {ch["finish_reason"] for ch in choices} == {"abort"}
    assert [len(ch["token_ids"]) for ch in choices] == [steps_done] * 2
