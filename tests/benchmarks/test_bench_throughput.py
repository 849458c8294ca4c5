"""`kiln bench throughput`'s counts and lengths are checked before an engine is built: with
the default model and mode 3, building one is a compile of minutes."""
import pytest

from kiln.benchmarks.throughput import run_throughput
from kiln.engine.arg_utils import EngineArgs

from checkpoints import STORIES_DIR


@pytest.mark.parametrize("num_prompts, input_len", [(0, 8), (-3, 8), (2, 0), (2, -1)])
def test_counts_are_refused_before_an_engine_is_built(monkeypatch, num_prompts, input_len):
    """--num-prompts 0 and --input-len 0 were refused by random_prompts, called once the engine
    had loaded and compiled (helper-106)."""
    from kiln.engine import llm_engine

    def no_engine(*args, **kwargs):
        raise AssertionError("an engine was built before the flags were checked")

    monkeypatch.setattr(llm_engine.LLMEngine, "__init__", no_engine)
    args = EngineArgs(model=str(STORIES_DIR), enforce_eager=True, max_model_len=128)
    with pytest.raises(ValueError, match=r"--num-prompts and --input-len must be >= 1"):
        run_throughput(args, num_prompts, input_len, 4)
