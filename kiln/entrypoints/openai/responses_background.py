"""Background responses (`background: true` on POST /v1/responses, as vLLM and OpenAI serve them):
each runs in a task of its own, detached from the request that made it (a client that hangs up
aborts nothing). The store keeps its body: queued (what the POST answers), in_progress, then the
whole response (or cancelled / failed). A streamed one's events are kept, to replay with GET
/v1/responses/{id}?stream=true&starting_after=N. POST .../cancel aborts one; the server's
shutdown ends those still running (cancelled, with what they wrote), after its grace period.

Bounds: at most the store's max_stored run at once (each stays in the store while it runs: it is
never the one forgotten), a 429 past that; the events of the newest MAX_EVENT_LOGS finished
streams are kept (each as long as its answer), those of streams still running too.
"""
import asyncio
import json
from collections import OrderedDict
from collections.abc import AsyncIterator, Awaitable

from fastapi.responses import JSONResponse, Response, StreamingResponse

from kiln.engine.async_llm import AsyncLLM
from kiln.engine.request_stream import RequestStream
from kiln.entrypoints.openai.errors import OpenAIError
from kiln.entrypoints.openai.responses_objects import ResponsesResponse
from kiln.entrypoints.openai.responses_store import TURN_ON, ResponseStore, running
from kiln.entrypoints.openai.serving_engine import abort_unfinished, error_body_of
from kiln.logger import init_logger

logger = init_logger(__name__)

MAX_EVENT_LOGS = 64
# How long cancel (and shutdown) wait for an aborted response to store what it wrote before
# cancelling its task outright (its output then lost): an abort ends its stream at once.
_END_WAIT_S = 5.0


class EventLog:
    """A background stream's events as sent (event k has sequence_number k), and whether the
    stream has ended; any number of readers follow it."""

    def __init__(self):
        self.events: list[str] = []
        self.done = False
        self._grew = asyncio.Event()

    def append(self, event: str) -> None:
        self.events.append(event)
        self._wake()

    def close(self) -> None:
        self.done = True
        self._wake()

    def _wake(self) -> None:
        # a fresh event for the next wait: a reader that has not waited yet sees the new length
        self._grew.set()
        self._grew = asyncio.Event()

    async def follow(self, start: int) -> AsyncIterator[str]:
        """Events from index `start` on, as they come, until the stream's last."""
        i = start
        while True:
            while i < len(self.events):
                yield self.events[i]
                i += 1
            if self.done:
                return
            await self._grew.wait()


class _Run:
    def __init__(self, streams: list[RequestStream], log: EventLog | None):
        self.streams, self.log = streams, log
        self.task: asyncio.Task | None = None


class BackgroundResponses:
    def __init__(self, llm: AsyncLLM, store: ResponseStore):
        self.llm, self.store = llm, store
        self.runs: dict[str, _Run] = {}
        self.logs: OrderedDict[str, EventLog] = OrderedDict()  # streamed ones', newest last

    def check(self, req, rid: str) -> None:
        """Whether `req` can run as `rid`: no background response of that id running (a
        client's request_id may come again: 400), where its response is kept (it would take
        that one's place in the store); with background, the store on (400 naming the
        variable), store not false (400), fewer than the store's bound running (429)."""
        if rid in self.runs and self.store.keeps(req):
            raise OpenAIError(f"a background response with id {rid!r} is still running: give "
                              "another request_id (or X-Request-Id), or cancel that one first",
                              param="request_id", code="invalid_value")
        if not req.background:
            return
        if not self.store.enabled:
            raise OpenAIError("background=true needs the response store (a background response "
                              f"is polled with GET /v1/responses/{{id}}): start the server with "
                              f"{TURN_ON}, or omit background", param="background",
                              code="unsupported_parameter")
        if req.store is False:
            raise OpenAIError("background=true needs store=true (the default): a background "
                              "response is polled from the store", param="store",
                              code="invalid_value")
        if len(self.runs) >= self.store.max_stored:
            raise OpenAIError(f"{len(self.runs)} background responses are running, this "
                              f"server's most ({self.store.max_stored}, the response store's "
                              "bound); wait for some to finish or cancel them",
                              status=429, param="background",
                              code="too_many_background_responses")

    def start(self, queued: ResponsesResponse, previous, input, streams: list[RequestStream],
              work: Awaitable | AsyncIterator[str]) -> Response:
        """Run `work` (the collected answer, which stores it; or the stream's events) detached;
        the POST's answer: the queued response, or the stream's events as they come."""
        rid = queued.id
        self.store.put(queued.model_dump(), previous, input)
        log = None if isinstance(work, Awaitable) else EventLog()
        run = self.runs[rid] = _Run(streams, log)
        if log is not None:
            self.logs.pop(rid, None)  # a finished namesake's (a client's request_id again)
            self.logs[rid] = log
        run.task = asyncio.create_task(self._run(rid, run, work), name=f"background {rid}")
        if log is None:
            return JSONResponse(queued.model_dump())
        return StreamingResponse(log.follow(0), media_type="text/event-stream")

    async def _run(self, rid: str, run: _Run, work) -> None:
        self._set(rid, status="in_progress")
        error = None
        try:
            if run.log is None:
                await work
            else:
                async for event in work:
                    run.log.append(event)
                    if event.startswith("event: error\n"):  # the stream's in-band error
                        error = json.loads(event.split("data: ", 1)[1])
        except asyncio.CancelledError:
            self._set(rid, status="cancelled")
            raise
        except Exception as e:  # noqa: BLE001 - the client polls for it: failed, with why
            logger.warning("background response %s failed: %s", rid, e)
            error = error_body_of(e)["error"]
        finally:
            abort_unfinished(self.llm, run.streams)
            self.runs.pop(rid, None)
            if run.log is not None:
                run.log.close()
                self._trim_logs()
        if error is not None:  # the work stored nothing
            self._set(rid, status="failed",
                      error={"code": error.get("code") or "server_error",
                             "message": error["message"]})

    def _set(self, rid: str, **fields) -> None:
        """Update a running response's stored body (a finished one keeps its end)."""
        body = self.store.peek(rid)
        if body is not None and running(body):
            body.update(fields)

    def _trim_logs(self) -> None:
        finished = [rid for rid in self.logs if rid not in self.runs]
        for rid in finished[:max(0, len(finished) - MAX_EVENT_LOGS)]:
            del self.logs[rid]

    def replay(self, response_id: str, stream: bool, starting_after: int | None
               ) -> AsyncIterator[str]:
        """GET /v1/responses/{id}?stream=true[&starting_after=N]: a streamed background
        response's events after event N (from the first without it), then those to come."""
        body = self.store.get(response_id)
        if not stream:
            raise OpenAIError("starting_after needs stream=true (it picks where a replay of the "
                              "events starts)", param="starting_after", code="invalid_value")
        if starting_after is not None and starting_after < 0:
            raise OpenAIError(f"starting_after={starting_after} must be >= 0 (an event's "
                              "sequence_number), or omitted to replay from the first",
                              param="starting_after", code="invalid_value")
        log = self.logs.get(response_id)
        if log is None:
            kind = "a background" if body.get("background") else "a synchronous"
            raise OpenAIError(f"stream=true replays the events of a response made with "
                              "background=true and stream=true (kept while it runs, and for "
                              f"the newest {MAX_EVENT_LOGS} finished ones); {response_id!r} is "
                              f"{kind} response with none kept: retrieve it without stream",
                              param="stream", code="invalid_value")
        return log.follow(0 if starting_after is None else starting_after + 1)

    async def cancel(self, response_id: str) -> dict:
        """POST /v1/responses/{id}/cancel: a running background response aborted; it ends
        cancelled with what it wrote (one that finished first keeps its end). Cancelling a
        cancelled one returns it, as OpenAI's; a synchronous or finished one is a 400."""
        body = self.store.get(response_id)
        run = self.runs.get(response_id)
        if run is None:
            if not body.get("background"):
                raise OpenAIError("Cannot cancel a synchronous response: only background "
                                  "responses (background=true) can be cancelled",
                                  code="invalid_value")
            if body["status"] != "cancelled":
                raise OpenAIError(f"Cannot cancel response {response_id!r}: it is already "
                                  f"{body['status']}", code="invalid_value")
            return body
        await self._end([run])
        return self.store.get(response_id)

    async def _end(self, runs: list[_Run]) -> None:
        """Abort `runs`' requests (their streams end "abort": each stores what it wrote,
        cancelled), then wait for their tasks; cancel any that do not end."""
        try:
            await self.llm.abort([s.request_id for r in runs for s in r.streams
                                  if not s.finished])
        except Exception as e:  # noqa: BLE001 - a dead engine failed their streams already
            logger.warning("aborting background responses failed: %s", e)
        tasks = {r.task for r in runs}
        _, stuck = await asyncio.wait(tasks, timeout=_END_WAIT_S)
        for t in stuck:
            t.cancel()
        if stuck:
            await asyncio.wait(stuck)

    async def wait_idle(self) -> None:
        """Until none runs (the server's grace period: its end aborts them)."""
        while self.runs:
            await asyncio.wait({r.task for r in self.runs.values()})

    async def close(self) -> None:
        """The server's shutdown: those still running end, cancelled."""
        if self.runs:
            logger.info("shutting down: cancelling %d background response(s)", len(self.runs))
            await self._end(list(self.runs.values()))
