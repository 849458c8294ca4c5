"""A worker's sleep mode (vLLM's --enable-sleep-mode) and the RL weight hooks collective_rpc
reaches: sleep gives the KV cache back and keeps, offloads or discards the weights; wake_up
brings back what its tags name; load_weights / reload_weights change the weights in place.

Level 1 keeps the weights (on CUDA in host memory, copied back on wake_up; on CPU they are in
host memory already and stay); level 2 discards them: wake_up(["weights"]) gives their memory
back uninitialised and they must be loaded (`load_weights` with every weight, or
`reload_weights`) before the engine steps again (`weights_missing` says how many are not).
"""
import gc

import torch

from kiln.errors import ConfigError
from kiln.logger import init_logger
from kiln.worker import weight_update

logger = init_logger(__name__)

TAGS = ("weights", "kv_cache")


class WorkerSleepMode:
    """Mixed into `Worker` (worker.py): its model runner, KV cache and config."""

    asleep: frozenset = frozenset()  # the tags whose memory is given back
    sleep_level = 0
    weights_discarded = False  # by level 2, until every weight is loaded again
    _parts_loaded: set = set()  # what load_weights filled since the discard

    def check_sleep_mode_fits(self) -> None:
        """CUDA graphs replay the addresses they were recorded with; a KV cache and weights that
        sleep come back elsewhere (Kiln has no virtual-memory allocator keeping them, as vLLM's
        cumem allocator does): refused at start-up rather than replaying stale memory."""
        from kiln.cudagraphs.mode import CUDAGraphMode

        mode = self.model_runner.cudagraph_dispatcher.cudagraph_mode
        if self.kiln_config.model_config.enable_sleep_mode and mode != CUDAGraphMode.NONE:
            raise ConfigError(f"--enable-sleep-mode with CUDA graphs (cudagraph_mode "
                              f"{mode.name}): the memory a sleep frees comes back at new "
                              "addresses, which recorded graphs would not read; add "
                              "--enforce-eager or -O.cudagraph_mode=NONE")

    def get_model(self) -> torch.nn.Module:
        """The loaded model (nn.Module), beneath any CUDA graph wrapper."""
        model = self.model_runner.model
        return model.unwrap() if hasattr(model, "unwrap") else model

    # ---- sleep / wake_up -----------------------------------------------------------------------
    def sleep(self, level: int = 1) -> None:
        if level not in (1, 2):
            raise ValueError(f"a worker sleeps at level 1 or 2, not {level!r}")
        if self.asleep:
            logger.warning("sleep(level=%d): the worker is already asleep", level)
            return
        model = self.get_model()
        if level == 2:  # refused before anything is let go
            weight_update.check_updatable(model, self.kiln_config.model_config.quantization,
                                          "sleep(level=2) discards the weights to be loaded "
                                          "again")
        self._release_kv_cache()
        if level == 2:
            for param in model.parameters():  # the same tensor, its storage emptied
                param.untyped_storage().resize_(0)
            self._drop_packed(model)
            self.weights_discarded, self._parts_loaded = True, set()
        elif self.device.type == "cuda":
            for param in model.parameters():
                param.data = param.data.to("cpu").pin_memory()
        self.asleep, self.sleep_level = frozenset(TAGS), level
        self._give_back_memory()

    def wake_up(self, tags=None) -> None:
        """`tags`: of TAGS (None: all), checked by the engine core (kiln/core/core_sleep.py)."""
        tags = TAGS if tags is None else tags
        if "weights" in tags and "weights" in self.asleep:
            for param in self.get_model().parameters():
                storage = param.untyped_storage()
                if storage.nbytes() == 0 and param.numel():  # discarded (level 2): memory
                    storage.resize_((param.storage_offset() + param.numel())  # again, unset
                                    * param.element_size())
                elif param.device != self.device:  # offloaded (level 1, CUDA)
                    param.data = param.data.to(self.device)
            self.asleep -= {"weights"}
        if "kv_cache" in tags and "kv_cache" in self.asleep:
            self.initialize_cache(self.num_blocks)
            self.asleep -= {"kv_cache"}

    def is_sleeping(self) -> bool:
        return bool(self.asleep)

    def _release_kv_cache(self) -> None:
        # the C++ attention kernel's table holds the caches weakly (attention_op.LayerTable);
        # a draft model's layers are among them (speculative decoding)
        for layer in self._attention_layers():
            layer.kv_cache = None

    def _drop_packed(self, model) -> None:
        # a discarded weight's oneDNN copy is stale too: an empty stand-in until it is packed
        # again (a graph input must stay a tensor)
        for module in model.modules():
            packed = getattr(module, "cpu_packed", None)
            if packed is not None:
                module.cpu_packed = torch.empty(0)

    def _give_back_memory(self) -> None:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    # ---- weights -------------------------------------------------------------------------------
    def load_weights(self, weights) -> list[str]:
        """vLLM's RL hook: HF-named (name, tensor) pairs written into the model in place (each
        rank takes its shard); the parts loaded, sorted."""
        self._check_weights_awake("load_weights")
        loaded = weight_update.load_in_place(self.get_model(), weights, self.kiln_config)
        if self.weights_discarded:
            self._parts_loaded |= loaded
            self.weights_discarded = bool(self.get_model().missing_weights(self._parts_loaded))
        return sorted(loaded)

    def reload_weights(self) -> None:
        """vLLM's: every weight read again from the engine's checkpoint."""
        self._check_weights_awake("reload_weights")
        weight_update.reload_from_checkpoint(self.get_model(), self.kiln_config)
        self.weights_discarded = False

    def weights_missing(self) -> int:
        """How many weights a level-2 sleep discarded that are not loaded again."""
        if not self.weights_discarded:
            return 0
        return len(self.get_model().missing_weights(self._parts_loaded))

    def _check_weights_awake(self, what: str) -> None:
        if "weights" in self.asleep:
            raise ConfigError(f"{what}: the weights are asleep; call wake_up(tags=['weights']) "
                              "first")
        weight_update.check_updatable(self.get_model(),
                                      self.kiln_config.model_config.quantization, what)
