"""Where a data-parallel replica runs: its own GPUs of the visible ones, or its share of the CPU
cores (or of a KILN_CPU_OMP_THREADS_BIND list), decided before its core process starts."""
import os
from collections.abc import Sequence

from kiln.errors import ConfigError


def replica_placement(index: int, kiln_config, available_cores: Sequence[int],
                      front_end_cores: int, cuda_devices: Sequence[str] | None) -> tuple:
    """(environment, cores) of replica `index`: on CUDA its own tp x pp devices of the visible
    ones; on CPU (KILN_CPU_OMP_THREADS_BIND auto) an equal share of the cores left once the
    front end has its own (where enough are left), so replicas' OpenMP threads never share;
    with core lists, its own tp x pp of them (cpu_binding.replica_binding), which its ranks
    read (and a one-process replica is pinned to)."""
    pc = kiln_config.parallel_config
    dp, world = pc.data_parallel_size, pc.world_size
    if kiln_config.device_config.device_obj.type == "cuda":
        if cuda_devices is None or len(cuda_devices) < dp * world:
            raise ConfigError(f"data_parallel_size {dp} x tensor_parallel_size x pipeline_"
                              f"parallel_size ({world}) needs {dp * world} GPUs, "
                              f"{len(cuda_devices or ())} visible; lower --data-parallel-size")
        mine = cuda_devices[index * world:(index + 1) * world]
        return {"CUDA_VISIBLE_DEVICES": ",".join(mine)}, None
    from kiln import envs
    from kiln.distributed.cpu_binding import cores_for_rank, parse_core_list, replica_binding

    bind = envs.cpu_omp_threads_bind()
    if bind == "nobind":
        return {}, None
    if bind != "auto":
        mine = replica_binding(bind, index, dp, world)
        one_process = pc.distributed_executor_backend == "uni"
        return ({"KILN_CPU_OMP_THREADS_BIND": mine},
                parse_core_list(mine) if one_process else None)
    cores = sorted(available_cores)
    if len(cores) - front_end_cores >= dp:
        cores = cores[:len(cores) - front_end_cores]
    return {}, cores_for_rank("auto", index, dp, cores)


def visible_cuda_devices() -> list[str] | None:
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    if listed is not None:
        return [d.strip() for d in listed.split(",") if d.strip()]
    import torch

    return [str(i) for i in range(torch.cuda.device_count())]
