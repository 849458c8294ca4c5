"""The engine core process: builds an EngineCore and runs it in a busy loop, talking over ZeroMQ.

Between steps it takes every message waiting (add, abort, finish, utility calls); each step's
outputs go back at once, so the front end's tokenizing and detokenizing never delay a step. A rank
process that dies while it waits fails the core at once, as a failed step does (the loop:
`core_loop.py`; this file: the process's start-up, hand-over and exit).
"""
import logging
import os
import signal
import sys
import threading
import time
import traceback

import zmq

from kiln.core.core_loop import CoreLoop
from kiln.core.core_messages import Ready, failure_report, output_codec
from kiln.errors import is_user_error
from kiln.logger import init_logger
from kiln.process_signals import STOP_SIGNAL, exit_once, leave_group_signals_to_parent

logger = init_logger(__name__)

_PARENT_CHECK_S = 0.5


def _exit_with_parent(parent_pid: int, addresses: tuple[str, ...]) -> None:
    """A core whose front end died (kill -9) must not live on holding the model and the port's
    clients: it exits as soon as it is re-parented, removing the sockets the front end bound
    (a killed front end runs no cleanup, and nobody else knows of them)."""
    def watch():
        while True:
            time.sleep(_PARENT_CHECK_S)
            if os.getppid() != parent_pid:
                _remove_ipc_sockets(addresses)
                os._exit(1)

    threading.Thread(target=watch, name="kiln-core-parent-watch", daemon=True).start()


def _remove_ipc_sockets(addresses: tuple[str, ...]) -> None:
    """Unlink the ipc:// socket files, then their directory (the front end's own, holding
    nothing else: rmdir leaves one that does)."""
    paths = [a.removeprefix("ipc://") for a in addresses if a.startswith("ipc://")]
    for path in paths:
        try:
            os.unlink(path)
        except OSError:
            pass  # a front end that exited cleanly removed it first
    for directory in {os.path.dirname(p) for p in paths}:
        try:
            os.rmdir(directory)
        except OSError:
            pass


def _leave_cores(kiln_config, executor_class: type, front_end_cores: int) -> int:
    """Shrink the model's OpenMP threads so the front end's event loop and tokenizer threads
    find a free core (vLLM-CPU reserves one too): a thread of the core that loses its core to
    them stalls every parallel region of a step. The threads steps run with."""
    import torch

    from kiln.config.compilation_config import CompilationMode
    from kiln.distributed.cpu_binding import cores_to_leave, leave_cores_to_front_end
    from kiln.executor.uniproc_executor import UniprocExecutor

    front_end_cores = cores_to_leave(
        front_end_cores, device=kiln_config.device_config.device_obj.type,
        model_here=issubclass(executor_class, UniprocExecutor),
        guarded=kiln_config.compilation_config.mode == CompilationMode.STOCK_TORCH_COMPILE)
    if front_end_cores:
        changed = leave_cores_to_front_end(front_end_cores)
        if changed is not None:
            logger.info("engine core: %d OpenMP threads of %d, %d core(s) left to the front "
                        "end (KILN_CPU_NUM_OF_RESERVED_CPU)", changed[1], changed[0],
                        changed[0] - changed[1])
    return torch.get_num_threads()


def run_engine_core(kiln_config, executor_class: type, input_address: str, output_address: str,
                    parent_pid: int, launched_at: float, goodbye_fd: int | None = None,
                    front_end_cores: int = 0, float32_matmul_precision: str | None = None) -> None:
    """The process's work, once its arguments are read (kiln.engine.core_client starts it).
    `goodbye_fd`: written to as the last act before exiting (core_interpreter.py).
    `front_end_cores`: cores a CPU model running here leaves to the front end once warm.
    `float32_matmul_precision`: the front end's torch setting, applied before the model loads,
    as an in-process core would have it."""
    # Ctrl-C and a service manager's SIGTERM reach the whole process group: the front end
    # decides what stops (after its grace period), and tells us by message or STOP_SIGNAL.
    leave_group_signals_to_parent("engine core")
    signal.signal(STOP_SIGNAL, exit_once)
    _exit_with_parent(parent_pid, (input_address, output_address))
    ctx = zmq.Context()
    input_socket = ctx.socket(zmq.PULL)
    input_socket.connect(input_address)
    output_socket = ctx.socket(zmq.PUSH)
    output_socket.setsockopt(zmq.LINGER, 5000)
    output_socket.connect(output_address)
    encoder, _ = output_codec()
    core = None
    code = 0
    try:
        from kiln.compilation import preload
        from kiln.config.compilation_config import CompilationMode
        from kiln.core.engine_core import EngineCore

        if float32_matmul_precision is not None:
            import torch

            torch.set_float32_matmul_precision(float32_matmul_precision)
        imported = time.monotonic()
        if kiln_config.compilation_config.mode != CompilationMode.NONE:
            preload.start()  # beside the model load
        core = EngineCore(kiln_config, executor_class)
        num_threads = _leave_cores(kiln_config, executor_class, front_end_cores)
        # time.monotonic() is one clock for every process of the machine (Linux).
        timings = {"core_process_start_s": imported - launched_at, **core.startup_timings}
        output_socket.send(encoder.encode(Ready(num_blocks=core.num_blocks,
                                                max_model_len=core.max_model_len,
                                                num_threads=num_threads,
                                                timings=timings)))
        CoreLoop(core, input_socket, output_socket).run()
    except BaseException as e:  # noqa: BLE001 - the front end must learn why, then we exit
        if not isinstance(e, SystemExit):
            # A setting the model or machine cannot meet is the front end's to report, in one
            # line; a bug's traceback is logged here.
            user_error = is_user_error(e)
            logger.log(logging.DEBUG if user_error else logging.ERROR, "engine core failed: %s",
                       "".join(traceback.format_exception(e)))
            output_socket.send(encoder.encode(failure_report(e)))
            code = 1
    finally:
        if core is not None:
            try:
                core.shutdown()
            except Exception:  # noqa: BLE001 - exiting anyway
                logger.exception("engine core shutdown failed")
        input_socket.close(linger=0)
        output_socket.close()
        ctx.term()
    if os.getppid() != parent_pid:  # an orphan (its front end killed): nobody else will
        _remove_ipc_sockets((input_address, output_address))
    from kiln.compilation.cache import remove_private_inductor_cache

    remove_private_inductor_cache()  # os._exit below runs no atexit handler
    # No interpreter teardown (torch's exit hooks take seconds): the front end waits for it.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    if goodbye_fd is not None:
        try:
            os.write(goodbye_fd, b"\0")
        except OSError:  # the front end is gone
            pass
    os._exit(code)


# What the model load imports: done here, while the front end resolves the config, not after
# it arrives. The config itself needs no transformers (a checkpoint's is an HFConfigSnapshot;
# a transformers config object given by the caller imports its class as it is unpickled).
_PREIMPORTS = ("kiln.model.registry", "kiln.model.loader.gguf_loader",
               "kiln.model.loader.hf_loader")


def _preimport() -> None:
    import importlib

    for name in _PREIMPORTS:
        try:
            importlib.import_module(name)
        except ImportError:
            pass


def main() -> None:
    import pickle

    # Started before the caller's config exists: import the engine while it is resolved.
    import kiln.core.engine_core  # noqa: F401
    import kiln.executor.uniproc_executor  # noqa: F401

    _preimport()

    try:
        sys.path[:0] = [p for p in pickle.load(sys.stdin.buffer) if p not in sys.path]
        arguments = pickle.load(sys.stdin.buffer)
    except EOFError:  # the front end ended before handing the engine over: nothing to run
        sys.exit(1)
    run_engine_core(*arguments)


if __name__ == "__main__":
    main()
