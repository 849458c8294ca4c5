"""A guard that compiling a piece puts on the piece's symbolic size (Triton's 32-bit indexing
check does, on GPU) must not reach Dynamo's guard building, which has no source for the symbol.
Reproduced on CPU by a compiler that asks the same question of its example inputs: the eager
one, as the guard comes from the question and not from what the compiler makes."""
import torch

from kiln.compilation.compile_state import compile_state_of
from kiln.compilation.compiler_interface import EagerAdaptor
from kiln.compilation.warmup import compile_and_warm_up

import toy_model as tm


def test_a_guard_on_a_piece_size_does_not_break_the_trace(monkeypatch, tmp_path):
    compile_piece = EagerAdaptor.compile
    asked = []

    def compile_with_a_guard(self, graph, example_inputs, config, shape, save_path=None):
        sizes = [x.shape[0] for x in example_inputs
                 if isinstance(x, torch.Tensor) and isinstance(x.shape[0], torch.SymInt)]
        if shape is None and sizes:
            asked.append(bool(64 * sizes[0] <= 2 ** 31 - 1))  # evaluating it records a guard
        return compile_piece(self, graph, example_inputs, config, shape, save_path)

    monkeypatch.setattr(EagerAdaptor, "compile", compile_with_a_guard)
    config = tm.toy_config(mode=3, backend="eager", cache_dir=str(tmp_path / "cache"))
    model = tm.build(config)
    with torch.no_grad():
        compile_and_warm_up(lambda n: model(*tm.inputs(n)), config,
                            compile_state_of(model).warmup_phase)
        got = model(*tm.inputs(5))
        expected = tm.build(tm.toy_config(mode=0))(*tm.inputs(5))
    assert asked and all(asked)
    torch.testing.assert_close(got, expected)
