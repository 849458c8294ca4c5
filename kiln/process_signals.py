"""Stop signals across Kiln's processes: the front end's SIGTERM, kept where its SystemExit is
lost; its children (engine core, ranks, bulk tokenizer) leave the group's signals to it.

A service manager stops a service by signalling every process of it (systemd's default), and
`timeout` or `kill -- -PGID` do the same: a child that died of it at once cut the requests the
server's grace period was about to finish. So a child deafens itself while its parent lives, and
its parent stops it by message, by STOP_SIGNAL (the core) or by SIGKILL (the others).
"""
import contextlib
import os
import signal
import sys
import threading

from kiln.logger import init_logger

# The front end's "exit now, cleanly" to an engine core that has not said goodbye (one still
# loading its model reads no message); SIGTERM no longer stops a core whose front end lives.
STOP_SIGNAL = signal.SIGUSR1

logger = init_logger(__name__)

_stopped_by: int | None = None
# How long a child waits before saying it ignored a SIGTERM: its parent dying of the same one
# has ended it by then.
_WARN_AFTER_S = 2.0


def terminate(signum, frame) -> None:
    """The `kiln` command's SIGTERM handler (`timeout`, `docker stop`, a service manager): unwind
    as Ctrl-C does, so the engine's finalizers stop its core and remove its socket directory
    (which dying at once left behind). The signal is kept: the SystemExit is lost where it lands
    in a __del__ or a broad except, and `kiln serve` must not go on to serve after it."""
    global _stopped_by
    _stopped_by = signum
    raise SystemExit(128 + signum)


def install_terminate() -> None:
    """Make SIGTERM unwind the `kiln` command (`terminate`). A SystemExit that lands in a
    finalizer is printed by CPython as "Exception ignored in ... Traceback" before it is lost;
    `exit_if_stopped` replays it, so the unraisable hook keeps that one quiet."""
    signal.signal(signal.SIGTERM, terminate)
    previous = sys.unraisablehook
    if getattr(previous, "quiets_lost_stop", False):  # main() runs again in one process (tests)
        return

    def quiet_lost_stop(unraisable) -> None:
        if isinstance(unraisable.exc_value, SystemExit) and _stopped_by is not None:
            return
        previous(unraisable)

    quiet_lost_stop.quiets_lost_stop = True
    sys.unraisablehook = quiet_lost_stop


def stopped_by() -> int | None:
    """The stop signal `terminate` took, if one came."""
    return _stopped_by


def exit_if_stopped() -> None:
    """Unwind now if a stop signal came whose SystemExit was lost (a command that built its
    engine and would go on working, or wait for input, regardless)."""
    if _stopped_by is not None:
        raise SystemExit(128 + _stopped_by)


@contextlib.contextmanager
def stops_deferred():
    """Ctrl-C and SIGTERM that come inside the block wait for its end, where they reach their
    handlers as they came. For a few calls that an exception must not split: one landing in
    pyzmq's Context.socket() leaves a socket its context does not know, and the context's
    destroy() then waits for it forever. Only the main thread is ever interrupted; elsewhere,
    and for a signal whose handler is not Python's (the default, ignored), nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    came: list[int] = []
    previous = {}
    for sig in (signal.SIGINT, signal.SIGTERM):
        if callable(signal.getsignal(sig)):
            previous[sig] = signal.signal(sig, lambda signum, _frame: came.append(signum))
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        for signum in came:
            signal.raise_signal(signum)


def exit_once(*_) -> None:
    """A signal handler: unwind (SystemExit 0), once: a second signal raised again inside the
    way out, and its SystemExit escaped into the interpreter's exit hooks (a traceback). The
    rest are caught and dropped, not ignored: CPython raises "Signal 15 ignored due to race
    condition" for one still pending when its handler becomes SIG_IGN (the group's SIGTERM and
    the front end's STOP_SIGNAL arrive together)."""
    for sig in (signal.SIGTERM, STOP_SIGNAL):
        signal.signal(sig, _drop)
    sys.exit(0)


def _drop(*_) -> None:
    pass


def die_with_parent() -> None:
    """A child's preexec_fn: the OS sends the child SIGTERM when the process that started it
    dies, however it dies (SIGKILL, the OOM killer), so no server started for a command is left
    running with nobody to stop it. Linux's prctl(PR_SET_PDEATHSIG); elsewhere nothing."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None).prctl(1, int(signal.SIGTERM))  # 1: PR_SET_PDEATHSIG


def leave_group_signals_to_parent(who: str) -> None:
    """In a child process: ignore Ctrl-C, and SIGTERM while the parent that started us lives
    (saying so once, for whoever signalled this process alone). An orphan exits on SIGTERM."""
    parent_pid = os.getppid()
    warned = False

    def warn_if_parent_lives() -> None:
        # Only for a SIGTERM meant for this process alone: one the parent got too (a script
        # under `timeout`) ends the parent, and the child with it, before this runs.
        if os.getppid() == parent_pid:
            logger.warning("%s (pid %d): SIGTERM ignored; its parent (pid %d) stops it once the "
                           "requests in flight have finished. To stop Kiln, signal the `kiln` "
                           "process itself.", who, os.getpid(), parent_pid)

    def on_sigterm(*_) -> None:
        nonlocal warned
        if os.getppid() != parent_pid:
            exit_once()
        if not warned:
            warned = True
            timer = threading.Timer(_WARN_AFTER_S, warn_if_parent_lives)
            timer.daemon = True
            timer.start()

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, on_sigterm)
