"""vLLM's development endpoints, served where `KILN_SERVER_DEV_MODE=1` (vLLM's
VLLM_SERVER_DEV_MODE): POST /reset_prefix_cache, for benchmarks that must start cold.
vLLM's /sleep, /wake_up and /collective_rpc have no counterpart here (kiln/vllm_envs.py says so
at start-up)."""
from fastapi import FastAPI, Query, Response

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
