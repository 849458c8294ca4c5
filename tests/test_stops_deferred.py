"""process_signals.stops_deferred: Ctrl-C and SIGTERM inside the block reach their handlers at
its end, in order; handlers that are not Python's, and other threads, are left alone."""
import signal
import threading

import pytest

from kiln.process_signals import stops_deferred


@pytest.fixture
def recorded_handlers():
    seen = []
    old = {sig: signal.signal(sig, lambda signum, _frame: seen.append(signum))
           for sig in (signal.SIGINT, signal.SIGTERM)}
    yield seen, old
    for sig, handler in old.items():
        signal.signal(sig, handler)


def test_signals_inside_wait_for_the_end_of_the_block(recorded_handlers):
    seen, _ = recorded_handlers
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    with stops_deferred():
        signal.raise_signal(signal.SIGTERM)
        signal.raise_signal(signal.SIGINT)
        assert seen == []
    assert seen == [signal.SIGTERM, signal.SIGINT]
    assert {sig: signal.getsignal(sig) for sig in handlers} == handlers


def test_a_handler_that_raises_raises_at_the_end_of_the_block(recorded_handlers):
    def stop(signum, _frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    reached = []
    with pytest.raises(SystemExit) as e:
        with stops_deferred():
            signal.raise_signal(signal.SIGTERM)
            reached.append("after the signal")
    assert e.value.code == 143 and reached == ["after the signal"]


def test_ignored_signals_stay_ignored(recorded_handlers):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    with stops_deferred():
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
        signal.raise_signal(signal.SIGTERM)  # ignored, inside and after
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN


def test_other_threads_change_nothing(recorded_handlers):
    seen, _ = recorded_handlers
    before = signal.getsignal(signal.SIGTERM)
    inside = []

    def run():
        with stops_deferred():
            inside.append(signal.getsignal(signal.SIGTERM))

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    assert inside == [before] and seen == []
