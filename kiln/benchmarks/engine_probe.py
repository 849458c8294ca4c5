"""What the benchmarks read off an in-process engine: its worker's model runner, the model and
the model's weight bytes (None behind executors whose ranks hold the model).
"""


def engine_runner(engine):
    """The model runner of an in-process engine's worker (None behind other executors: its
    ranks hold theirs)."""
    executor = getattr(engine.engine_core, "executor", None)
    return getattr(getattr(executor, "worker", None), "model_runner", None)


def engine_model(engine):
    """The model of an in-process engine's worker (None behind other executors)."""
    return getattr(engine_runner(engine), "model", None)


def model_weight_bytes(engine) -> int | None:
    """Bytes of the model's parameters and buffers (what one decode step must read at least)."""
    model = engine_model(engine)
    if model is None:
        return None
    tensors = list(model.parameters()) + list(model.buffers())
    return sum(t.numel() * t.element_size() for t in tensors if not t.is_meta)  # meta: let go
