"""The compile-stack preload: its module names import, on its thread, in a fresh process."""
import subprocess
import sys

_SCRIPT = """
import sys
from kiln.compilation import preload
assert not any(m in sys.modules for m in preload.MODULES)
preload.start()
preload.wait()
missing = [m for m in preload.MODULES if m not in sys.modules]
assert not missing, missing
from kiln.entrypoints.cli.main import exit_without_teardown
exit_without_teardown(0)  # torch's teardown is no part of the subject (seconds on 2 cores)
"""


def test_preload_imports_every_module_it_names():
    done = subprocess.run([sys.executable, "-c", _SCRIPT], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
