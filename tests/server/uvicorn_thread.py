"""Test helper: an ASGI app served by uvicorn on a free loopback port in a daemon thread, for
tests that need real HTTP (raw sockets, timeouts, schemathesis) rather than the test client."""
import contextlib
import threading
import time

import uvicorn

from kiln.executor.free_port import free_port


@contextlib.contextmanager
def uvicorn_in_thread(app, **config):
    """Yields the port once uvicorn has started; stops it on exit. `config`: more
    uvicorn.Config arguments (e.g. http=)."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning", lifespan="on", **config))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(30)
