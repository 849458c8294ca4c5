"""`/tokenize` of a huge text prompt in a child process that hands back the response's JSON bytes.

Why: the `tokenizers` backend releases the GIL while it encodes, but turning a 4 MB text's
million ids into a Python list holds it for ~14 ms, and their JSON, then freeing them, ~10 ms
more. On a front-end thread each hold is a pause of the event loop, and of every stream's next
token. In the child those holds are its own; the front end only moves bytes through a pipe.
"""
import os
import select
import struct
import subprocess
import sys
import threading
import time

import msgspec

_HEADER = struct.Struct("<Q")  # a frame: its length, then its bytes
# How long one call may take before the child is deemed hung and replaced (a 4 MB text takes
# about 1.3 s on one core; the child runs at a low priority on cores the engine may fill).
CALL_TIMEOUT_S = 120.0
# Children in a row that fail before answering, after which none is started again.
MAX_FAILURES = 3


def tokenize_response_json(ids: list[int], max_model_len: int, strs: list[str] | None) -> bytes:
    """TokenizeResponse(...).model_dump(exclude_none=True) as JSON, without the model: msgspec
    encodes a million ids in ms, where pydantic validates and copies the list twice."""
    body = {"tokens": ids, "count": len(ids), "max_model_len": max_model_len}
    if strs is not None:
        body["token_strs"] = strs
    return msgspec.json.encode(body)


class _Setup(msgspec.Struct):
    tokenizer_json: str
    # Not in the tokenizer's JSON: a runtime flag (transformers' split_special_tokens).
    encode_special_tokens: bool


class _Request(msgspec.Struct):
    text: str
    add_special_tokens: bool
    max_model_len: int


class _Reply(msgspec.Struct):
    body: bytes | None = None
    error: str | None = None


class BulkTokenizerDied(RuntimeError):
    """The child could not answer (it died, hung, or could not start); the caller tokenizes
    the text itself."""


def _send(fd: int, data: bytes, deadline: float | None) -> None:
    """One frame to `fd`; TimeoutError past `deadline` (time.monotonic())."""
    view = memoryview(_HEADER.pack(len(data)) + data)
    while view:
        _wait(fd, deadline, write=True)
        try:
            view = view[os.write(fd, view):]
        except BlockingIOError:
            pass


def _receive(fd: int, deadline: float | None) -> bytes | None:
    """The next frame from `fd`, or None at its end (the other side is gone)."""
    header = _read_exact(fd, _HEADER.size, deadline)
    if header is None:
        return None
    return _read_exact(fd, _HEADER.unpack(header)[0], deadline)


def _read_exact(fd: int, size: int, deadline: float | None) -> bytes | None:
    chunks, left = [], size
    while left:
        _wait(fd, deadline, write=False)
        try:
            chunk = os.read(fd, min(left, 1 << 20))
        except BlockingIOError:
            continue
        if not chunk:
            return None
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def _wait(fd: int, deadline: float | None, write: bool) -> None:
    """Until `fd` is ready, or TimeoutError past `deadline`; with none, the fd blocks."""
    if deadline is None:
        return
    left = deadline - time.monotonic()
    ready = select.select([], [fd], [], max(0.0, left)) if write else \
        select.select([fd], [], [], max(0.0, left))
    if not any(ready):
        raise TimeoutError


def _child_command(niceness: int) -> list[str]:
    return [sys.executable, "-m", "kiln.engine.bulk_tokenizer", str(niceness)]


class BulkTokenizer:
    """A child process holding a copy of a `tokenizers.Tokenizer`. `start()` starts it; one
    call at a time (the front end's bulk lane has one thread); a child that dies or hangs is
    replaced on the next call, until MAX_FAILURES in a row have failed."""

    def __init__(self, backend, niceness: int = 0):
        """`backend`: the `tokenizers.Tokenizer` whose `encode_batch_fast` the caller would run
        (text_encoding.plain_backend); `niceness`: added, for the child, to that of the thread
        building this (its restarts, from a lowered thread, keep the same priority)."""
        self._backend = backend
        self._niceness = (min(19, os.getpriority(os.PRIO_PROCESS, 0) + niceness)
                          if hasattr(os, "getpriority") else 0)
        self._proc: subprocess.Popen | None = None
        self._unusable: str | None = None  # why no child is started any more
        self._failures = 0  # children in a row that did not answer
        self._lock = threading.Lock()

    @property
    def unusable(self) -> str | None:
        """Why no child will be started any more, or None."""
        return self._unusable

    def start(self) -> None:
        """Start the child now, not on the first huge text: serializing the tokenizer for it
        holds the GIL for tens of ms, which the event loop would wait out under load. Where it
        cannot start, huge texts are tokenized in this process (BulkTokenizerDied says why)."""
        with self._lock:
            try:
                self._started()
            except BulkTokenizerDied:
                pass

    def _started(self) -> subprocess.Popen:
        if self._unusable is not None:
            raise BulkTokenizerDied(self._unusable)
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        self._proc = None
        try:
            setup = msgspec.msgpack.encode(_Setup(
                self._backend.to_str(),
                bool(getattr(self._backend, "encode_special_tokens", False))))
            proc = subprocess.Popen(_child_command(self._niceness), stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE)
            for stream in (proc.stdin, proc.stdout):  # so that a deadline holds
                os.set_blocking(stream.fileno(), False)
        except Exception as e:  # noqa: BLE001 - an unserializable tokenizer, no interpreter
            self._unusable = f"the bulk tokenizer process cannot start ({e})"
            raise BulkTokenizerDied(self._unusable) from e
        try:
            _send(proc.stdin.fileno(), setup, time.monotonic() + CALL_TIMEOUT_S)
        except (OSError, TimeoutError):
            pass  # it exited at once: the call's read finds it gone
        self._proc = proc
        return proc

    def tokenize_json(self, text: str, add_special_tokens: bool, max_model_len: int) -> bytes:
        """tokenize_response_json of the backend's ids for `text`, computed in the child.
        Raises BulkTokenizerDied where the child could not answer."""
        request = msgspec.msgpack.encode(_Request(text, add_special_tokens, max_model_len))
        with self._lock:
            proc = self._started()
            deadline = time.monotonic() + CALL_TIMEOUT_S
            try:
                _send(proc.stdin.fileno(), request, deadline)
                frame = _receive(proc.stdout.fileno(), deadline)
                reply = None if frame is None else msgspec.msgpack.decode(frame, type=_Reply)
            except (OSError, TimeoutError, msgspec.DecodeError, ValueError):
                reply = None  # a broken pipe, a hung child, a garbled frame
            if reply is None:
                self._stop(proc)
                self._failures += 1
                why = ("the bulk tokenizer process did not answer (it exited, hung past "
                       f"{CALL_TIMEOUT_S:g} s, or garbled its reply)")
                if self._failures >= MAX_FAILURES:
                    self._unusable = f"{why}, {self._failures} times in a row"
                raise BulkTokenizerDied(why)
            self._failures = 0
        if reply.error is not None:
            raise RuntimeError(f"the bulk tokenizer process failed: {reply.error}")
        return reply.body

    def _stop(self, proc: subprocess.Popen | None, timeout: float = 2.0) -> None:
        if proc is None:
            return
        if self._proc is proc:
            self._proc = None
        for stream in (proc.stdin, proc.stdout):
            try:
                stream.close()
            except OSError:
                pass
        try:
            proc.wait(timeout)  # it exits at the end of its input
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()

    def close(self) -> None:
        """End the child, without waiting for a call in flight (which then ends in
        BulkTokenizerDied); no child starts after this."""
        self._unusable = "the server is shutting down"
        if not self._lock.acquire(blocking=False):
            proc = self._proc
            if proc is not None:
                proc.kill()  # the call in flight reads the end of its pipe
            self._lock.acquire()
        try:
            self._stop(self._proc)
        finally:
            self._lock.release()


def main() -> None:
    """The child: argv[1] is the niceness to run at; stdin: the setup, then requests; the
    original stdout: one reply per request (fd 1 is pointed at stderr, so a stray print cannot
    break a frame). Ends at the end of stdin (the front end closed it, or died)."""
    from kiln.process_signals import leave_group_signals_to_parent

    # Ctrl-C and SIGTERM reach the group: the server decides, and ends us by closing our input.
    leave_group_signals_to_parent("bulk tokenizer")
    replies = os.dup(1)
    os.dup2(2, 1)
    try:
        os.setpriority(os.PRIO_PROCESS, 0, max(os.getpriority(os.PRIO_PROCESS, 0),
                                               int(sys.argv[1])))
    except (AttributeError, OSError):
        pass
    from tokenizers import Tokenizer

    requests = sys.stdin.buffer.fileno()
    frame = _receive(requests, None)
    if frame is None:
        return
    setup = msgspec.msgpack.decode(frame, type=_Setup)
    backend = Tokenizer.from_str(setup.tokenizer_json)
    backend.encode_special_tokens = setup.encode_special_tokens
    while (frame := _receive(requests, None)) is not None:
        request = msgspec.msgpack.decode(frame, type=_Request)
        try:
            ids = backend.encode_batch_fast([request.text],
                                            add_special_tokens=request.add_special_tokens)[0].ids
            reply = _Reply(body=tokenize_response_json(ids, request.max_model_len, None))
        except Exception as e:  # noqa: BLE001 - the front end reports it on the request
            reply = _Reply(error=f"{type(e).__name__}: {e}")
        _send(replies, msgspec.msgpack.encode(reply), None)


if __name__ == "__main__":
    main()
