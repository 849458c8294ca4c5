"""Helpers of the Inductor stack's tests: where _child.py lives, a forward without grad, and a
warm start of the toy model into a given cache under expected counter deltas."""
from pathlib import Path

import torch

from kiln.compilation.compile_state import compile_state_of
from kiln.compilation.counters import compilation_counter
from kiln.compilation.warmup import compile_and_warm_up

import toy_model as tm

HERE = Path(__file__).parents[1]  # tests/compilation: _child.py, toy_model.py


def _run(model, n):
    with torch.no_grad():
        return model(*tm.inputs(n))


def _warm_model(cache: Path, deltas: dict, compile_sizes=(1, 8), **config_args):
    config = tm.toy_config(mode=3, compile_sizes=list(compile_sizes), cache_dir=str(cache),
                           **config_args)
    model = tm.build(config)
    with compilation_counter.expect(**deltas):
        with torch.no_grad():
            compile_and_warm_up(lambda n: model(*tm.inputs(n)), config,
                                compile_state_of(model).warmup_phase)
    return model
