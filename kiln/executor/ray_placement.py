"""What the Ray executor decides before and while it places its ranks: whether the cluster
named can be reached, the resources its placement group asks for (and the error where the
cluster cannot hold them, now or after a wait), each rank's place on its machine, and what each
rank actor's process is started with.
"""
import socket
import time

from kiln import envs
from kiln.errors import ConfigError
from kiln.logger import init_logger

logger = init_logger(__name__)

# How long a RAY_ADDRESS may refuse connections (a head still starting) before the engine says
# so: ray.init itself retries an address nobody listens on for good, warning every 40 s.
RAY_CONNECT_WAIT_S = 10.0


def check_ray_address(address: str | None, wait_s: float | None = None) -> None:
    """Raise ValueError naming RAY_ADDRESS when its host:port accepts no connection within
    `wait_s` (RAY_CONNECT_WAIT_S); other forms (auto, local, ray://) are Ray's to resolve."""
    if not address or "://" in address:
        return
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        return
    wait_s = RAY_CONNECT_WAIT_S if wait_s is None else wait_s
    deadline = time.monotonic() + wait_s
    while True:
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=2.0):
                return
        except OSError as e:
            if time.monotonic() >= deadline:
                raise ConfigError(
                    f"RAY_ADDRESS={address!r}: no Ray cluster answers there ({e}) after "
                    f"{wait_s:g} s; start one (ray start --head --port {port}), correct "
                    "RAY_ADDRESS, or unset it to have Kiln start a local Ray") from None
        time.sleep(0.5)


# What ranks never read and a runtime_env would show to anyone who can list the cluster's actors.
_NOT_FOR_RANKS = frozenset({"KILN_API_KEY", "VLLM_API_KEY"})


def kiln_env_vars(environ) -> dict[str, str]:
    """The KILN_* settings of this process, and the vLLM variables read in their place
    (envs.VLLM_NAMES), for each rank actor's runtime_env: without them a rank on a cluster
    started elsewhere read its own (KILN_CPU_OMP_THREADS_BIND=nobind, say, still bound its
    cores)."""
    vllm_names = set(envs.VLLM_NAMES.values())
    return {name: value for name, value in environ.items()
            if (name.startswith("KILN_") or name in vllm_names) and name not in _NOT_FOR_RANKS}


def _needed(bundles: list[dict]) -> dict:
    needed: dict = {}
    for bundle in bundles:
        for name, amount in bundle.items():
            needed[name] = needed.get(name, 0) + amount
    return needed


def never_fits(bundles: list[dict], total: dict) -> bool:
    """Whether the bundles need more of a resource than the whole cluster has (else they fit
    once other jobs free what they hold)."""
    return any(total.get(name, 0) < amount for name, amount in _needed(bundles).items())


def placement_error(bundles: list[dict], why: str, total: dict,
                    available: dict) -> ValueError:
    # A ValueError, as vLLM's: a setting the cluster cannot meet, said in one line (a
    # RuntimeError printed the core's traceback and the command's)
    return ValueError(
        f"Ray cannot place {len(bundles)} ranks (tensor_parallel_size x "
        f"pipeline_parallel_size), one bundle of {bundles[0]} each: {why}. Asked for "
        f"{_needed(bundles)} in all; the cluster has {resources(total)} in all, "
        f"{resources(available)} available now. Lower -tp / -pp, add nodes or resources to "
        "the cluster (ray start --num-cpus / --num-gpus), or free what other jobs hold")


# How often a placement waiting for resources says what it waits for (silence looked like a hang).
PLACEMENT_LOG_S = 15.0


def wait_for_placement(ray, pg, bundles: list[dict], timeout_s: float) -> None:
    """Wait until Ray has placed the group `pg` of `bundles`, saying what it waits for every
    PLACEMENT_LOG_S; the placement error after `timeout_s` (the ranks' start-up timeout)."""
    ready = pg.ready()
    start = time.monotonic()
    while True:
        left = timeout_s - (time.monotonic() - start)
        if ray.wait([ready], timeout=max(0.0, min(PLACEMENT_LOG_S, left)))[0]:
            ray.get(ready)  # raises where the group failed rather than was placed
            return
        waited = time.monotonic() - start
        if waited >= timeout_s:
            raise placement_error(bundles, f"still unplaced after {waited:.0f} s",
                                  ray.cluster_resources(), ray.available_resources())
        logger.warning("waiting %.0f s so far for Ray to place %d ranks of %s each; the "
                       "cluster has %s available (of %s); gives up after %.0f s",
                       waited, len(bundles), bundles[0],
                       resources(ray.available_resources()),
                       resources(ray.cluster_resources()), timeout_s)


def resources(resources: dict) -> dict:
    """The resources a bundle asks for (not Ray's memory and per-node bookkeeping keys)."""
    return {k: v for k, v in resources.items() if k in ("CPU", "GPU")}


def node_visible_devices(node_ips: list[str], gpu_ids: list[list[str]]) -> list[str]:
    """CUDA_VISIBLE_DEVICES for each rank: every GPU Ray gave the ranks on its machine (as vLLM
    sets it). Ray shows each 1-GPU actor its own GPU only, as cuda:0, while a rank opens
    cuda:<local rank>: the second rank of a machine failed with "invalid device ordinal"."""
    by_node: dict[str, set[str]] = {}
    for ip, ids in zip(node_ips, gpu_ids):
        by_node.setdefault(ip, set()).update(ids)

    def order(gpu: str):  # numerically where Ray gives numbers, else (UUIDs) as text
        return (0, int(gpu), "") if gpu.isdigit() else (1, 0, gpu)

    return [",".join(sorted(by_node[ip], key=order)) for ip in node_ips]


def local_ranks(node_ips: list[str]) -> list[tuple[int, int]]:
    """(local rank, ranks on that machine) for each global rank, from each rank's node IP."""
    out = []
    for rank, ip in enumerate(node_ips):
        same = [r for r, other in enumerate(node_ips) if other == ip]
        out.append((same.index(rank), len(same)))
    return out
