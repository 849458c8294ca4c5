"""`/tokenize` of a huge text in a child process that hands back the response's JSON bytes.

Why: the `tokenizers` backend releases the GIL while it encodes, but turning a 4 MB text's
million ids into a Python list holds it for ~14 ms, and their JSON, then freeing them, ~10 ms
more. On a front-end thread each hold is a pause of the event loop, and of every stream's next
token. In the child those holds are its own; the front end only moves bytes through a pipe.
"""
import os
import struct
import subprocess
import sys
import threading

import msgspec

_HEADER = struct.Struct("<Q")  # a frame: its length, then its bytes


def tokenize_response_json(ids: list[int], max_model_len: int, strs: list[str] | None) -> bytes:
    """TokenizeResponse(...).model_dump(exclude_none=True) as JSON, without the model: msgspec
    encodes a million ids in ms, where pydantic validates and copies the list twice."""
    body = {"tokens": ids, "count": len(ids), "max_model_len": max_model_len}
    if strs is not None:
        body["token_strs"] = strs
    return msgspec.json.encode(body)


class _Request(msgspec.Struct):
    text: str
    add_special_tokens: bool
    max_model_len: int


class _Reply(msgspec.Struct):
    body: bytes | None = None
    error: str | None = None


def _write_frame(stream, data: bytes) -> None:
    stream.write(_HEADER.pack(len(data)))
    stream.write(data)
    stream.flush()


def _read_frame(stream) -> bytes | None:
    """The next frame, or None at the end of the stream (the other side is gone)."""
    header = stream.read(_HEADER.size)
    if len(header) < _HEADER.size:
        return None
    (size,) = _HEADER.unpack(header)
    data = stream.read(size)
    return data if len(data) == size else None


class BulkTokenizerDied(RuntimeError):
    """The child exited (killed, out of memory) before answering; the caller tokenizes itself."""


class BulkTokenizer:
    """A child process holding a copy of a `tokenizers.Tokenizer`: started on first use, one
    call at a time (the front end's bulk lane has one thread), started again after a death."""

    def __init__(self, backend, niceness: int = 0):
        """`backend`: the `tokenizers.Tokenizer` whose `encode_batch_fast` the caller would run
        (text_encoding.plain_backend); `niceness`: added to this process's, for the child."""
        self._backend = backend
        self._niceness = niceness
        self._proc: subprocess.Popen | None = None
        self._lock = threading.Lock()

    def start(self) -> None:
        """Start the child now, not on the first huge text: serializing the tokenizer for it
        holds the GIL for tens of ms, which the event loop would wait out under load."""
        with self._lock:
            self._started()

    def _started(self) -> subprocess.Popen:
        if self._proc is None or self._proc.poll() is not None:
            target = min(19, os.getpriority(os.PRIO_PROCESS, 0) + self._niceness) \
                if hasattr(os, "getpriority") else 0
            self._proc = subprocess.Popen(
                [sys.executable, "-m", "kiln.engine.bulk_tokenizer", str(target)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            _write_frame(self._proc.stdin, self._backend.to_str().encode())
        return self._proc

    def tokenize_json(self, text: str, add_special_tokens: bool, max_model_len: int) -> bytes:
        """tokenize_response_json of the backend's ids for `text`, computed in the child.
        Raises BulkTokenizerDied where the child could not answer."""
        request = msgspec.msgpack.encode(_Request(text, add_special_tokens, max_model_len))
        with self._lock:
            try:
                proc = self._started()
                _write_frame(proc.stdin, request)
                frame = _read_frame(proc.stdout)
            except OSError:  # a broken pipe: it died while we wrote
                frame = None
            if frame is None:
                self._stop()
                raise BulkTokenizerDied("the bulk tokenizer process exited before answering")
        reply = msgspec.msgpack.decode(frame, type=_Reply)
        if reply.error is not None:
            raise RuntimeError(f"the bulk tokenizer process failed: {reply.error}")
        return reply.body

    def _stop(self, timeout: float = 2.0) -> None:
        proc, self._proc = self._proc, None
        if proc is None:
            return
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
        with self._lock:
            self._stop()


def main() -> None:
    """The child: argv[1] is the niceness to run at; stdin: the tokenizer's JSON, then requests;
    stdout: one reply per request. Ends at the end of stdin (the front end closed it or died)."""
    from tokenizers import Tokenizer

    try:
        os.setpriority(os.PRIO_PROCESS, 0, max(os.getpriority(os.PRIO_PROCESS, 0),
                                               int(sys.argv[1])))
    except (AttributeError, OSError):
        pass
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    frame = _read_frame(stdin)
    if frame is None:
        return
    backend = Tokenizer.from_str(frame.decode())
    while (frame := _read_frame(stdin)) is not None:
        request = msgspec.msgpack.decode(frame, type=_Request)
        try:
            ids = backend.encode_batch_fast([request.text],
                                            add_special_tokens=request.add_special_tokens)[0].ids
            reply = _Reply(body=tokenize_response_json(ids, request.max_model_len, None))
        except Exception as e:  # noqa: BLE001 - the front end reports it on the request
            reply = _Reply(error=f"{type(e).__name__}: {e}")
        _write_frame(stdout, msgspec.msgpack.encode(reply))


if __name__ == "__main__":
    main()
