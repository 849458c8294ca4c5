"""A worker's sleep mode (vLLM's --enable-sleep-mode) and the RL weight hooks collective_rpc
reaches: sleep gives the KV cache back and keeps, offloads or discards the weights; wake_up
brings back what its tags name; load_weights / reload_weights change the weights in place.

Level 1 keeps the weights (on CUDA in host memory, copied back on wake_up; on CPU they are in
host memory already and stay); level 2 discards them: wake_up(["weights"]) gives their memory
back uninitialised and they must be loaded (`load_weights` with every weight, or
`reload_weights`) before the engine steps again (`weights_missing` says how many are not).
A speculative draft model or EAGLE head sleeps with the target, as under vLLM's allocator
(its weights and KV cache are the worker's too); `load_weights(model="draft")` updates it and
`reload_weights()` reads both checkpoints again.
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
    # by level 2: each model ("target", "draft") with weights to load -> the parts loaded since
    _parts_loaded: dict = {}

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

    def _models(self) -> dict[str, tuple[torch.nn.Module, object]]:
        """Each model whose weights sleep and update: "target", and "draft" where speculative
        decoding runs a draft model or EAGLE head -> (module, its engine config)."""
        models = {"target": (self.get_model(), self.kiln_config)}
        drafter = self.model_runner.drafter
        if drafter is not None:
            models["draft"] = (drafter.model, drafter.kiln_config)
        return models

    def _parameters(self) -> list[torch.nn.Parameter]:
        """Every model's parameters, once each (an EAGLE head reads the target's embedding and
        LM head without holding them, but a tied parameter is listed under two names)."""
        seen: dict[int, torch.nn.Parameter] = {}
        for model, _ in self._models().values():
            for param in model.parameters():
                seen.setdefault(id(param), param)
        return list(seen.values())

    def _held_parameters(self) -> list[torch.nn.Parameter]:
        """The parameters holding data: a dense copy let go at load (on the meta device, where
        a quantized or GGUF-packed form serves the layer) has none to offload or bring back."""
        return [param for param in self._parameters() if not param.is_meta]

    # ---- sleep / wake_up -----------------------------------------------------------------------
    def sleep(self, level: int = 1) -> None:
        if level not in (1, 2):
            raise ValueError(f"a worker sleeps at level 1 or 2, not {level!r}")
        if self.asleep:
            logger.warning("sleep(level=%d): the worker is already asleep", level)
            return
        models = self._models()
        if level == 2:  # refused before anything is let go
            for name, (model, config) in models.items():
                weight_update.check_updatable(model, config.model_config,
                                              f"sleep(level=2) discards the {name} model's "
                                              "weights to be loaded again")
        self._release_kv_cache()
        if level == 2:
            for param in self._parameters():  # the same tensor, its storage emptied
                param.untyped_storage().resize_(0)
            for model, _ in models.values():
                self._drop_packed(model)
            self._parts_loaded = {name: set() for name in models}
        elif self.device.type == "cuda":
            for param in self._held_parameters():
                param.data = param.data.to("cpu").pin_memory()
        self.asleep, self.sleep_level = frozenset(TAGS), level
        self._give_back_memory()

    def wake_up(self, tags=None) -> None:
        """`tags`: of TAGS (None: all), checked by the engine core (kiln/core/core_sleep.py)."""
        tags = TAGS if tags is None else tags
        if "weights" in tags and "weights" in self.asleep:
            for param in self._held_parameters():
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
    def load_weights(self, weights, model: str = "target") -> list[str]:
        """vLLM's RL hook: HF-named (name, tensor) pairs written into `model` ("target", or
        "draft": the speculative draft model / EAGLE head, as vLLM's start_draft_weight_update
        aims an update at it) in place (each rank takes its shard); the parts loaded, sorted."""
        module, config = self._model_named(model, "load_weights")
        self._check_weights_awake("load_weights", {model: (module, config)})
        loaded = weight_update.load_in_place(module, weights, config)
        if model in self._parts_loaded:
            self._parts_loaded[model] |= loaded
            if not module.missing_weights(self._parts_loaded[model]):
                del self._parts_loaded[model]
        return sorted(loaded)

    def reload_weights(self, model: str | None = None) -> None:
        """vLLM's: every weight read again from the engine's checkpoint; a draft model's (or
        EAGLE head's) from its own checkpoint too (`model`: "target" or "draft" for one)."""
        models = self._models()
        if model is not None:
            models = {model: self._model_named(model, "reload_weights")}
        self._check_weights_awake("reload_weights", models)
        for name, (module, config) in models.items():
            weight_update.reload_from_checkpoint(module, config)
            self._parts_loaded.pop(name, None)

    def kv_cache_scales(self) -> list[tuple[float, float]]:
        """Each attention layer's fp8 cache (k_scale, v_scale), the draft's included: the
        engine core compares them around a collective_rpc (kiln/core/core_sleep.py)."""
        return [(layer.impl.k_scale, layer.impl.v_scale) for layer in self._attention_layers()]

    def weights_missing(self) -> int:
        """How many weights a level-2 sleep discarded that are not loaded again (the draft's
        included)."""
        models = self._models()
        return sum(len(models[name][0].missing_weights(parts))
                   for name, parts in self._parts_loaded.items())

    def _model_named(self, model, what: str) -> tuple:
        models = self._models()
        if model not in models:
            raise ValueError(f"{what}: model must be one of {sorted(models)}, got {model!r}"
                             + ("" if "draft" in models else " (no --speculative-config runs a "
                                "draft model or EAGLE head here)"))
        return models[model]

    def _check_weights_awake(self, what: str, models: dict) -> None:
        if "weights" in self.asleep:
            raise ConfigError(f"{what}: the weights are asleep; call wake_up(tags=['weights']) "
                              "first")
        for name, (module, config) in models.items():
            weight_update.check_updatable(module, config.model_config,
                                          what if name == "target" else f"{what} (the draft)")
