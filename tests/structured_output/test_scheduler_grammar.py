"""The scheduler's side of structured outputs: a request waits unscheduled (others run) until
its grammar compiles; identical grammars compile once; the sampling step carries its bitmask row;
tokens advance the matcher. The backend here is a small fake grammar over the test vocabulary."""
import threading

import numpy as np

from kiln.core.outputs import EMPTY_MODEL_RUNNER_OUTPUT, ModelRunnerOutput
from kiln.core.scheduler import Scheduler
from kiln.sampling_params import StructuredOutputsParams
from tests.core.doubles import VOCAB, make_config, make_request


class FakeMatcher:
    """Allows only `allowed` ids; accepted tokens are recorded."""

    def __init__(self, allowed):
        self.allowed, self.accepted = allowed, []
        self.ends = set()  # tokens that end the grammar when accepted

    def is_terminated(self):
        return bool(self.accepted) and self.accepted[-1] in self.ends

    def fill_next_token_bitmask(self, bitmask, row):
        bitmask[row] = 0
        for t in self.allowed:
            bitmask[row, t // 32] |= 1 << (t % 32)

    def accept_token(self, token):
        self.accepted.append(token)
        return token in self.allowed


class FakeBackend:
    bitmask_width = (VOCAB + 31) // 32

    def __init__(self):
        self.release = threading.Event()
        self.compiled = []

    def compile(self, spec):
        self.release.wait(10)
        self.compiled.append(spec)
        return spec

    def matcher(self, compiled, stop_token_ids):
        return FakeMatcher({5, 40, 77})

    def token_ids(self, text):
        assert text == "</think>"
        return [900, 901]


def make():
    config = make_config()
    sched = Scheduler(config, num_blocks=64)
    backend = sched.structured_output_manager._backend = FakeBackend()
    return sched, backend


def regex(pattern="a+"):
    return StructuredOutputsParams(regex=pattern)


def test_waits_for_its_grammar_while_others_run():
    sched, backend = make()
    sched.add_request(make_request("g", [1, 2, 3], structured_outputs=regex()))
    sched.add_request(make_request("plain", [4, 5, 6]))
    so = sched.schedule()
    assert list(so.num_scheduled_tokens) == ["plain"] and so.grammar_bitmask is None
    assert [r.request_id for r in sched.waiting] == ["g"]  # kept its place
    sched.update_from_output(so, ModelRunnerOutput(req_ids=["plain"],
                                                   sampled_token_ids=[[9]]))
    backend.release.set()
    sched.structured_output_manager._cache[sched.requests["g"]
                                            .structured_output_request.spec].result(10)
    so = sched.schedule()
    assert set(so.num_scheduled_tokens) == {"g", "plain"}
    # Only g samples under a grammar: its row allows exactly the fake grammar's tokens.
    assert so.structured_output_request_ids == ["g"]
    bits = np.unpackbits(so.grammar_bitmask.view(np.uint8), bitorder="little")[:VOCAB]
    assert set(np.flatnonzero(bits)) == {5, 40, 77}
    ids = list(so.num_scheduled_tokens)
    tokens = {"g": [40], "plain": [9]}
    sched.update_from_output(so, ModelRunnerOutput(req_ids=ids,
                                                   sampled_token_ids=[tokens[r] for r in ids]))
    assert sched.requests["g"].structured_output_request.matcher.accepted == [40]


def test_same_grammar_compiles_once_and_nothing_runs_while_compiling():
    sched, backend = make()
    for i in range(3):
        sched.add_request(make_request(f"r{i}", [1, 2], structured_outputs=regex("b+")))
    sched.add_request(make_request("other", [1, 2], structured_outputs=regex("c+")))
    so = sched.schedule()
    assert so.total_num_scheduled_tokens == 0
    sched.update_from_output(so, EMPTY_MODEL_RUNNER_OUTPUT)
    backend.release.set()
    for r in list(sched.requests.values()):
        while not r.structured_output_request.is_ready():
            r.structured_output_request.wait(1)
    so = sched.schedule()
    assert len(so.num_scheduled_tokens) == 4
    assert sorted(s.text for s in backend.compiled) == ["b+", "c+"]


def test_a_failed_compile_ends_only_that_request():
    sched, backend = make()
    backend.release.set()

    def broken(spec):
        raise RuntimeError("too big")

    backend.compile = broken
    sched.add_request(make_request("bad", [1, 2], structured_outputs=regex()))
    sched.add_request(make_request("ok", [3, 4]))
    grammar = sched.requests["bad"].structured_output_request
    while not grammar.is_ready():
        grammar.wait(1)
    so = sched.schedule()
    assert list(so.num_scheduled_tokens) == ["ok"]
    outs = sched.update_from_output(so, ModelRunnerOutput(req_ids=["ok"],
                                                          sampled_token_ids=[[9]]))
    assert [(o.request_id, o.finish_reason) for o in outs if o.request_id == "bad"] == \
        [("bad", "abort")]
    assert "bad" not in sched.requests and "too big" in grammar.error
    assert next(o.error for o in outs if o.request_id == "bad") == grammar.error


def test_grammar_waits_for_the_end_of_reasoning():
    """reasoning_end: nothing is constrained (no bitmask row, the matcher sees nothing) until
    the output ends with the marker's tokens; from the next token on, the grammar holds."""
    sched, backend = make()
    backend.release.set()
    so_params = StructuredOutputsParams(regex="a+", reasoning_end="</think>")
    sched.add_request(make_request("t", [1, 2], max_tokens=20, structured_outputs=so_params))
    grammar = sched.requests["t"].structured_output_request
    while not grammar.is_ready():
        grammar.wait(1)
    rows = []
    for token in [7, 900, 8, 900, 901, 40, 5]:
        so = sched.schedule()
        rows.append(so.structured_output_request_ids)
        sched.update_from_output(so, ModelRunnerOutput(req_ids=["t"],
                                                       sampled_token_ids=[[token]]))
    assert rows == [[]] * 5 + [["t"]] * 2
    assert grammar.matcher.accepted == [40, 5]


def test_a_grammar_ended_by_a_stop_token_ends_the_request_before_min_tokens():
    """The sampler lets a finished grammar's stop token win over min_tokens (test_grammar_mask):
    the request ends there, where it went on unconstrained until max_tokens."""
    sched, backend = make()
    backend.release.set()
    sched.add_request(make_request("g", [1, 2], max_tokens=20, min_tokens=10, stop_token_ids=[77],
                                   structured_outputs=regex()))
    sched.add_request(make_request("plain", [1, 2], max_tokens=20, min_tokens=10,
                                   stop_token_ids=[77]))
    grammar = sched.requests["g"].structured_output_request
    while not grammar.is_ready():
        grammar.wait(1)
    grammar.matcher.ends = {77}
    finished = {}
    for tokens in ([40, 40], [77, 77]):
        so = sched.schedule()
        ids = list(so.num_scheduled_tokens)
        by_id = dict(zip(["g", "plain"], tokens))
        for o in sched.update_from_output(so, ModelRunnerOutput(
                req_ids=ids, sampled_token_ids=[[by_id[r]] for r in ids])):
            finished[o.request_id] = (o.finish_reason, o.stop_reason)
    assert finished["g"] == ("stop", 77)
    assert finished["plain"] == (None, None)  # below min_tokens, no grammar: it goes on


def test_grammar_compiles_yield_the_cpu_to_engine_steps():
    """A compile may take minutes (50,000 choices) and outlive its request; at the engine's
    priority it slowed every stream's steps about 4x on 2 cores."""
    import os
    import threading
    from types import SimpleNamespace

    from kiln.structured_output.manager import GRAMMAR_NICENESS, StructuredOutputManager

    manager = StructuredOutputManager(SimpleNamespace(model_config=SimpleNamespace(
        vocab_size=8)))
    manager._compile = lambda spec: os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    base = os.getpriority(os.PRIO_PROCESS, 0)
    assert manager._compiled("spec").result(timeout=10) == min(19, base + GRAMMAR_NICENESS)
    manager._pool.shutdown()


def test_a_grammar_that_fails_to_compile_is_compiled_once():
    """n samples of one request each start their grammar: a failing compile ran n times."""
    from types import SimpleNamespace

    from kiln.structured_output.manager import StructuredOutputManager

    manager = StructuredOutputManager(SimpleNamespace(model_config=SimpleNamespace(
        vocab_size=8)))
    calls = []

    def failing(spec):
        calls.append(spec)
        raise ValueError("no such rule")

    manager._compile = failing
    first = manager._compiled("spec")
    assert isinstance(first.exception(timeout=10), ValueError)
    assert manager._compiled("spec") is first and calls == ["spec"]
    manager._pool.shutdown()
