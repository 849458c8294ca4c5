"""The engine core's interpreter, started before the engine's config exists (and, for a `kiln`
command that builds an engine, before the command's own imports: `prestart`).

Light on purpose (no torch, no zmq): the CLI imports it first thing.
"""
import atexit
import os
import pickle
import signal
import subprocess
import sys
import time

# Spins of libgomp's wait (GOMP_SPINCOUNT) before an idle OpenMP thread sleeps: enough to bridge
# the gaps between one step's parallel regions (fewer slowed batch-1 decode), short against the
# gaps between steps and the front end's bursts of work.
CORE_SPIN_COUNT = 10_000


def set_openmp_wait(env) -> None:
    """In `env` (a dict, or os.environ before torch loads libgomp): OpenMP threads that spin
    briefly between parallel regions, then sleep, unless the user chose a wait policy or spin
    count. Sleeping at once (OMP_WAIT_POLICY=PASSIVE) wakes a thread for every region of a step,
    which made batch-1 decode several times slower; spinning for long (libgomp's default)
    keeps a core from the front end's tokenizing, and a spinning thread that loses its core
    stalls every step (docs/architecture.md and docs/measurements.md have the figures)."""
    if "OMP_WAIT_POLICY" not in env:
        env.setdefault("GOMP_SPINCOUNT", str(CORE_SPIN_COUNT))


def core_environment(environ) -> dict:
    """The core process's environment: the caller's, with set_openmp_wait's OpenMP wait."""
    env = dict(environ)
    set_openmp_wait(env)
    address = _this_process_ray()
    if address and not env.get("RAY_ADDRESS"):
        env["RAY_ADDRESS"] = address
    return env


def _this_process_ray() -> str | None:
    """The address of the Ray this process joined or started (`ray.init()` before `LLM`), so a
    core on --distributed-executor-backend ray places its ranks there: its own ray.init() found
    no cluster to join and started a second one, deaf to the caller's num_cpus and resources.
    Ray is not imported here (it is not, unless the caller did)."""
    ray = sys.modules.get("ray")
    try:
        if ray is None or not ray.is_initialized():
            return None
        return ray.get_runtime_context().gcs_address
    except Exception:  # noqa: BLE001 - a Ray in an odd state: the core starts its own, as before
        return None


def _float32_matmul_precision() -> str | None:
    """This process's torch.set_float32_matmul_precision, for the core to load under: a GGUF
    model's float32 kernels read it at load (gguf_matmul.float32_limbs), and the core's fresh
    interpreter had torch's default whatever the caller set. None where torch is not imported."""
    torch = sys.modules.get("torch")
    return None if torch is None else torch.get_float32_matmul_precision()


# `python -m kiln.core.core_process`, deaf to Ctrl-C and SIGTERM from its exec: the terminal and
# service managers signal the whole process group, and the front end decides what stops (a
# Ctrl-C while the core imported torch printed its KeyboardInterrupt traceback). Ignored
# dispositions survive exec and Python leaves an ignored SIGINT alone, so the interpreter's own
# start-up, before this first line runs, is covered too (`_deaf`); the line keeps them so.
# The module is an argument of its own, so `ps` (and a test) still sees the process's job.
_BOOT = ("import signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
         "signal.signal(signal.SIGTERM, signal.SIG_IGN); import runpy; "
         "runpy.run_module(sys.argv[1], run_name='__main__', alter_sys=True)")
_MODULE = "kiln.core.core_process"


def _deaf(cores: list[int] | None) -> None:
    """In the child, before exec: SIGINT and SIGTERM ignored, and pinned to `cores` (OpenMP
    sizes its pool by the cores the process may use, once)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if cores is not None:
        os.sched_setaffinity(0, cores)


class CoreInterpreter:
    """`python -m kiln.core.core_process`, started before the engine's config exists: it imports
    torch and the engine (seconds) while this process resolves the config and loads the
    tokenizer, then waits on stdin for its start-up arguments."""

    def __init__(self, env: dict | None = None, cores: list[int] | None = None):
        """`env`: variables set for this core only (a data-parallel replica's devices);
        `cores`: the CPU cores it (and the ranks it starts) may run on, from its first line."""
        self.launched_at = time.monotonic()
        # The core writes a byte here as its last act: then only the kernel's teardown of its
        # memory is left (0.16 s for the default model on 2 cores), which shutdown need not wait.
        self.goodbye, goodbye_w = os.pipe()
        try:
            self.proc = subprocess.Popen([sys.executable, "-c", _BOOT, _MODULE],
                                         stdin=subprocess.PIPE,
                                         env={**core_environment(os.environ), **(env or {})},
                                         pass_fds=(goodbye_w,), preexec_fn=lambda: _deaf(cores))
        except BaseException:
            os.close(self.goodbye)
            raise
        finally:
            os.close(goodbye_w)
        self._goodbye_w = goodbye_w  # its number, the same in the child

    def start(self, kiln_config, executor_class: type, input_address: str,
              output_address: str, front_end_cores: int = 0) -> subprocess.Popen:
        """Hand over the arguments, pickled (the config is not a request: only requests and
        outputs must cross without pickle); the caller's sys.path first, so a test's executor
        class imports there too."""
        try:
            pickle.dump(sys.path, self.proc.stdin)
            pickle.dump((kiln_config, executor_class, input_address, output_address,
                         os.getpid(), self.launched_at, self._goodbye_w, front_end_cores,
                         _float32_matmul_precision()), self.proc.stdin)
            self.proc.stdin.close()
        except BaseException:
            self.discard()
            raise
        return self.proc

    def discard(self) -> None:
        """Not needed after all (a bad flag): end it."""
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        os.close(self.goodbye)


_prestarted: list[CoreInterpreter] = []


def prestart() -> None:
    """Start the interpreter now, for the next engine this process builds (`take`): it imports
    torch and the engine while this process does the same (about a second on 2 cores). One not
    taken by exit (the command failed first) is ended then."""
    if not _prestarted:
        _prestarted.append(CoreInterpreter())
        atexit.register(_discard_prestarted)


def take() -> CoreInterpreter:
    """The prestarted interpreter if there is one (once), else a new one."""
    return _prestarted.pop() if _prestarted else CoreInterpreter()


def _discard_prestarted() -> None:
    while _prestarted:
        _prestarted.pop().discard()
