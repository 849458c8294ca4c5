"""Signals in Kiln's child processes (engine core, ranks, bulk tokenizer): Ctrl-C and SIGTERM sent
to the whole process group are the front end's to act on; it stops its children once done.

A service manager stops a service by signalling every process of it (systemd's default), and
`timeout` or `kill -- -PGID` do the same: a child that died of it at once cut the requests the
server's grace period was about to finish. So a child deafens itself while its parent lives, and
its parent stops it by message, by STOP_SIGNAL (the core) or by SIGKILL (the others).
"""
import os
import signal
import sys

from kiln.logger import init_logger

# The front end's "exit now, cleanly" to an engine core that has not said goodbye (one still
# loading its model reads no message); SIGTERM no longer stops a core whose front end lives.
STOP_SIGNAL = signal.SIGUSR1

logger = init_logger(__name__)


def exit_once(*_) -> None:
    """A signal handler: unwind (SystemExit 0), once: a second signal raised again inside the
    way out, and its SystemExit escaped into the interpreter's exit hooks (a traceback)."""
    for sig in (signal.SIGTERM, STOP_SIGNAL):
        signal.signal(sig, signal.SIG_IGN)
    sys.exit(0)


def leave_group_signals_to_parent(who: str) -> None:
    """In a child process: ignore Ctrl-C, and SIGTERM while the parent that started us lives
    (saying so once, for whoever signalled this process alone). An orphan exits on SIGTERM."""
    parent_pid = os.getppid()
    warned = False

    def on_sigterm(*_) -> None:
        nonlocal warned
        if os.getppid() != parent_pid:
            exit_once()
        if not warned:
            warned = True
            logger.warning("%s (pid %d): SIGTERM ignored; its parent (pid %d) stops it once the "
                           "requests in flight have finished. To stop Kiln, signal the `kiln` "
                           "process itself.", who, os.getpid(), parent_pid)

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, on_sigterm)
