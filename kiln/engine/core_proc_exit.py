"""How the engine core's process ends, seen from the front: its exit named as an error, the
watcher that reaps it and tells the client, and the finalizer that stops it (core_client.py).
"""
import os
import shutil
import subprocess

from kiln.engine.core_errors import EngineCoreDeadError
from kiln.process_signals import STOP_SIGNAL


def exit_error(proc: subprocess.Popen) -> EngineCoreDeadError:
    """What the exited core's callers raise: its exit code or the signal that killed it."""
    # Exited (its pidfd said so); the watcher thread may be reaping it: wait for that.
    wait_briefly(proc, 5)
    code = proc.returncode
    how = f"was killed by signal {-code}" if code is not None and code < 0 else \
        f"exited with code {code}"
    return EngineCoreDeadError(f"the engine core process (pid {proc.pid}) {how}; requests "
                               "in flight are lost: restart the engine")


def wait_briefly(proc: subprocess.Popen, timeout: float) -> None:
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        pass


def watch_exit(client_ref, proc) -> None:
    """Tell the death callbacks at once, even while nobody waits on outputs (an idle server);
    holds the client weakly so a dropped engine is still collected."""
    proc.wait()
    client = client_ref()
    if client is not None:
        client.on_exit()


def terminate(owner_pid, proc, ctx, tmpdir, sentinel, closing, goodbye, said_goodbye) -> None:
    """The client's finalizer: stops a core that has not said goodbye, frees the sockets."""
    if os.getpid() != owner_pid:
        # A forked child's exit (the finalizer runs at exit in every process that has it): the
        # core is its parent's, and the parent's watcher held the Popen's wait lock at the fork,
        # so waiting here would hang for good.
        return
    closing.set()
    if not said_goodbye.is_set() and proc.poll() is None:
        proc.send_signal(STOP_SIGNAL)  # SIGTERM is the group's: a core ignores it
        wait_briefly(proc, 5)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    os.close(sentinel)
    os.close(goodbye)
    ctx.destroy(linger=0)
    shutil.rmtree(tmpdir, ignore_errors=True)
