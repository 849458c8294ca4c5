"""The `kiln` command's SIGTERM: a SystemExit that lands in a finalizer is lost there, replayed
later, and prints no "Exception ignored ... Traceback" on its way."""
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import os, signal, time
    from kiln import process_signals

    process_signals.install_terminate()
    process_signals.install_terminate()  # main() may run twice in one process

    class Finalized:
        def __del__(self):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.2)  # the handler runs here, inside __del__

    Finalized()
    print("went on", flush=True)
    process_signals.exit_if_stopped()
    print("not reached", flush=True)
""")


def test_a_stop_lost_in_a_finalizer_exits_143_without_a_traceback():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 143, done.stderr
    assert done.stdout == "went on\n"
    assert "Traceback" not in done.stderr and "Exception ignored" not in done.stderr, done.stderr


def test_other_unraisable_errors_still_print():
    script = SCRIPT.replace("os.kill(os.getpid(), signal.SIGTERM)", "raise KeyError('boom')")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and "KeyError: 'boom'" in done.stderr, done.stderr
