"""vLLM's development endpoints, served where `KILN_SERVER_DEV_MODE=1` (vLLM's
VLLM_SERVER_DEV_MODE): POST /reset_prefix_cache, the sleep mode's POST /sleep, POST /wake_up and
GET /is_sleeping, and POST /collective_rpc (a worker method by name, string arguments)."""
import json
from typing import Any

from fastapi import FastAPI, Query, Request, Response
from fastapi.responses import JSONResponse

from kiln.engine.engine_sleep import check_rpc_timeout
from kiln.entrypoints.openai.errors import OpenAIError
from kiln.logger import init_logger

logger = init_logger(__name__)


def add_dev_routes(app: FastAPI, llm) -> None:
    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(reset_running_requests: bool = Query(default=False)):
        """vLLM's: 200 whether or not the cache could be reset (running requests hold its
        blocks unless `reset_running_requests=true` sends them back to be recomputed)."""
        logger.info("resetting the prefix cache")
        if not await llm.reset_prefix_cache(reset_running_requests):
            logger.warning("the prefix cache was not reset: running requests hold its blocks "
                           "(POST /reset_prefix_cache?reset_running_requests=true)")
        return Response(status_code=200)

    @app.post("/sleep")
    async def sleep(level: int = Query(default=1), mode: str = Query(default="abort")):
        """vLLM's: level 0 pauses scheduling, 1 frees the KV cache, 2 also the weights; requests
        in flight end ("abort") or are recomputed after /wake_up ("keep"); new ones wait."""
        await _engine_call(llm.sleep, level, mode)
        return Response(status_code=200)

    @app.post("/wake_up")
    async def wake_up(request: Request):
        """vLLM's: `?tags=weights&tags=kv_cache` (or none: everything)."""
        tags = request.query_params.getlist("tags")
        logger.info("waking the engine up (tags: %s)", tags or "all")
        await _engine_call(llm.wake_up, tags or None)
        return Response(status_code=200)

    @app.get("/is_sleeping")
    async def is_sleeping():
        return JSONResponse({"is_sleeping": await llm.is_sleeping()})

    @app.post("/collective_rpc")
    async def collective_rpc(request: Request):
        """vLLM's: {"method": name, "args": [str, ...], "kwargs": {str: str}, "timeout": s};
        200 with {"results": [...]} (results not JSON-ready as their str), or empty where
        there are none; 504 naming the method where it outlives `timeout`."""
        method, args, kwargs, timeout = _rpc_body(await request.body())
        try:
            results = await _engine_call(llm.collective_rpc, method, timeout, tuple(args),
                                         kwargs)
        except TimeoutError as e:  # the workers' call runs on: not the client's error
            raise OpenAIError(str(e), status=504, param="timeout", code="timeout",
                              type="server_error") from None
        if results is None:
            return Response(status_code=200)
        return JSONResponse({"results": [r if r is None or isinstance(r, (dict, list)) else
                                         str(r) for r in results]})


async def _engine_call(call, *args):
    """An engine call whose bad argument (ValueError: a level, a tag, a worker method) is the
    client's 400, not a 500."""
    try:
        return await call(*args)
    except ValueError as e:
        raise OpenAIError(str(e)) from None


def _rpc_body(raw: bytes) -> tuple[str, list, dict, Any]:
    try:
        body = json.loads(raw or b"{}")
    except ValueError as e:
        raise OpenAIError(f"the body is not JSON: {e}") from None
    if not isinstance(body, dict) or not isinstance(body.get("method"), str):
        raise OpenAIError("the body must be a JSON object with 'method', a worker method's "
                          "name", param="method")
    args, kwargs = body.get("args", []), body.get("kwargs", {})
    if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
        raise OpenAIError("'args' must be a list of strings (vLLM passes them serialized)",
                          param="args")
    if not isinstance(kwargs, dict) or not all(isinstance(v, str) for v in kwargs.values()):
        raise OpenAIError("'kwargs' must be an object of strings (vLLM passes them serialized)",
                          param="kwargs")
    try:
        timeout = check_rpc_timeout(body.get("timeout"))
    except ValueError as e:
        raise OpenAIError(str(e), param="timeout") from None
    return body["method"], args, kwargs, timeout
