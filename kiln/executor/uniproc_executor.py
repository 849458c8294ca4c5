"""`UniprocExecutor`: the engine's single worker, in this process (no IPC, no distribution)."""
from kiln.core.outputs import ModelRunnerOutput, SchedulerOutput
from kiln.errors import ConfigError
from kiln.executor.abstract import Executor
from kiln.worker.worker import Worker


class UniprocExecutor(Executor):
    def __init__(self, kiln_config):
        super().__init__(kiln_config)
        world = kiln_config.parallel_config.world_size
        if world != 1:
            raise ConfigError(f"UniprocExecutor runs one worker; a world of {world} ranks "
                              "(tensor x pipeline parallel) needs the multiprocess executor "
                              "(--distributed-executor-backend mp)")
        self.worker = Worker(kiln_config, rank=0, local_rank=0)
        self.worker.init_device()
        self.worker.load_model()

    def determine_num_blocks(self) -> int:
        return self.worker.determine_num_blocks()

    def kv_cache_block_bytes(self) -> int:
        return self.worker.kv_cache_block_bytes()

    def initialize_cache(self, num_blocks: int, max_model_len: int | None = None) -> None:
        self.worker.initialize_cache(num_blocks, max_model_len)

    def compile_or_warm_up_model(self) -> None:
        self.worker.compile_or_warm_up_model()

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)

    def collective_rpc(self, method, args: tuple = (), kwargs: dict | None = None) -> list:
        return [self.worker.collective_rpc(method, tuple(args), kwargs)]

    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown()
            self.worker = None
