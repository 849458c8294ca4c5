"""vLLM's --no-enable-chunked-prefill: every prompt prefilled in one step, the budget at least
max_model_len, and the same greedy tokens as with chunked prefill."""
import pytest

from kiln import LLM, SamplingParams
from kiln.engine.arg_utils import EngineArgs
from kiln.errors import ConfigError

from checkpoints import STORIES_DIR


def _config(**kw):
    return EngineArgs(model=str(STORIES_DIR), device="cpu", **kw).create_kiln_config()


def test_the_budget_defaults_to_max_model_len_or_a_smaller_one_is_refused():
    sched = _config(enable_chunked_prefill=False, max_model_len=256).scheduler_config
    assert not sched.enable_chunked_prefill and sched.max_num_batched_tokens >= 256
    assert _config(max_num_batched_tokens=64, max_model_len=256).scheduler_config \
        .enable_chunked_prefill
    with pytest.raises(ConfigError, match=r"max_num_batched_tokens \(64\) is smaller than "
                       r"max_model_len \(256\).*raise --max-num-batched-tokens"):
        _config(enable_chunked_prefill=False, max_num_batched_tokens=64, max_model_len=256)


@pytest.mark.usefixtures("inprocess_core")
def test_whole_prompt_prefills_give_the_chunked_tokens():
    prompts = [{"prompt_token_ids": list(range(5, 5 + n))} for n in (100, 7, 60, 90, 3)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    tokens = {}
    for chunked, budget in ((True, 16), (False, 128)):
        llm = LLM(model=str(STORIES_DIR), dtype="float32", enforce_eager=True,
                  max_model_len=128, max_num_batched_tokens=budget,
                  max_num_seqs=4, enable_chunked_prefill=chunked)
        tokens[chunked] = [list(o.outputs[0].token_ids)
                           for o in llm.generate(prompts, params, use_tqdm=False)]
        llm.llm_engine.shutdown()
    assert tokens[False] == tokens[True]
