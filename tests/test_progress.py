"""Progress bars: drawn on a terminal (weight loading, compilation / warm-up), nothing at all
when stderr is a pipe or a file."""
import io
import sys
from types import SimpleNamespace

from kiln.compilation.warmup import compile_and_warm_up
from kiln.model.loader.hf_loader import load_hf_weights
from kiln.progress import progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


class CountingModel:
    def load_weights(self, weights):
        self.count = sum(1 for _ in weights)


def test_nothing_is_drawn_off_a_terminal(capsys, tiny_llama_dir):
    assert list(progress(range(3), desc="counting")) == [0, 1, 2]
    model = CountingModel()
    load_hf_weights(model, tiny_llama_dir)
    assert model.count > 0
    assert capsys.readouterr().err == ""


def test_weight_loading_and_warm_up_draw_on_a_terminal(monkeypatch, tiny_llama_dir):
    terminal = Terminal()
    monkeypatch.setattr(sys, "stderr", terminal)
    model = CountingModel()
    load_hf_weights(model, tiny_llama_dir)
    ran = []
    config = SimpleNamespace(
        scheduler_config=SimpleNamespace(max_num_batched_tokens=64),
        compilation_config=SimpleNamespace(compile_sizes=[4, 8], mode=0))
    compile_and_warm_up(ran.append, config, SimpleNamespace(end=lambda: None), [16])
    assert ran == [16]
    drawn = terminal.getvalue()
    assert "loading weights" in drawn and model.count > 0
    assert "warming up" in drawn


def test_bars_lock_with_a_thread_lock_not_a_semaphore():
    """tqdm's default lock holds a multiprocessing semaphore, which every rank process of a
    multi-rank engine left behind ("2 leaked semaphore objects" at each exit)."""
    import threading

    from tqdm import tqdm

    list(progress(range(3), desc="x"))
    assert isinstance(tqdm.get_lock(), type(threading.RLock()))
