"""A draft model and an EAGLE head on hybrid sliding-window targets keep the KV cache groups
(kiln/core/kv_cache_groups.py), their layers joining the groups of their kind as vLLM's do: a
Gemma-3-like target drafting with itself (every draft accepted: the draft's K/V in its groups'
blocks is right) and a Qwen2 target whose layer_types window a layer, under a random EAGLE head
that proposes what it proposes with one group. Greedy output is the one without speculation,
and the window group's blocks behind the window go back to the pool as requests run."""
import pytest

from kiln import SamplingParams

from .eagle_heads import write_head
from .test_draft_model import all_accepted
from .test_eagle import eagle_spec, record_proposals
from .test_spec_decode_e2e import generate, make, spec_totals
from checkpoints import make_tiny_checkpoint, random_prompts

pytestmark = pytest.mark.usefixtures("inprocess_core")  # the scheduler is read in this process

PROMPTS = random_prompts(2, [20, 13], seed=7)  # past the window of 8
PARAMS = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
SMALL = dict(block_size=4, max_model_len=128, max_num_batched_tokens=16, max_num_seqs=4,
             num_gpu_blocks_override=80, enforce_eager=True)


def run_recording_blocks(llm) -> tuple[list, int]:
    """Outputs, and the most blocks any window-group table held behind its last ones: asserts
    every full-group table keeps all of its blocks while some window table frees some."""
    scheduler = llm.llm_engine.engine_core.core.scheduler
    kv, schedule, freed = scheduler.kv_cache_manager, scheduler.schedule, []

    def recording():
        out = schedule()
        for tables in kv.req_to_group_blocks.values():
            for window, table in zip(kv.group_windows, tables):
                assert window is not None or None not in table
                freed.append(sum(b is None for b in table))
        return out

    scheduler.schedule = recording
    outs = generate(llm, PROMPTS, PARAMS)
    assert kv.num_free_blocks == kv.num_blocks
    return outs, max(freed)


def test_draft_model_on_a_windowed_target_keeps_the_groups(tiny_gemma3_dir):
    spec = {"method": "draft_model", "model": str(tiny_gemma3_dir), "num_speculative_tokens": 3}
    llm, base = make(tiny_gemma3_dir, spec, **SMALL), make(tiny_gemma3_dir, None, **SMALL)
    kv = llm.llm_engine.engine_core.core.scheduler.kv_cache_manager
    assert kv.group_windows == (None, 8)
    drafter = llm.llm_engine.engine_core.core.executor.worker.model_runner.drafter
    # the draft's window layer shares its tensor with the target's window layer's group
    assert [layer.kv_group for layer in drafter.attention_layers.values()] == [1, 0]
    before = spec_totals(llm)
    got, freed = run_recording_blocks(llm)
    assert freed > 0
    assert all_accepted(llm, before) > 0
    assert [o.token_ids for o in got] == [o.token_ids for o in generate(base, PROMPTS, PARAMS)]


def test_eagle_head_on_a_windowed_target_keeps_the_groups(tmp_path):
    target = make_tiny_checkpoint(tmp_path / "qwen2", "qwen2", tie=False, use_sliding_window=True,
                                  sliding_window=8, max_window_layers=1)  # layer 1 windowed
    head = write_head(tmp_path / "head", target, layer_types=["full_attention"],
                      use_sliding_window=False)
    llm = make(target, eagle_spec(head), **SMALL)
    kv = llm.llm_engine.engine_core.core.scheduler.kv_cache_manager
    assert kv.group_windows == (None, None, 8)  # the head's full layer has a group beside layer 0
    one = make(target, eagle_spec(head), disable_hybrid_kv_cache_manager=True, **SMALL)
    assert one.llm_engine.engine_core.core.scheduler.kv_cache_manager.group_windows == (None,)
    seen, seen_one = record_proposals(llm), record_proposals(one)
    got, freed = run_recording_blocks(llm)
    assert freed > 0
    assert [o.token_ids for o in got] == [o.token_ids for o in generate(one, PROMPTS, PARAMS)]
    # the head read its own K/V in its group's blocks: its drafts are those with one group
    assert seen and seen == seen_one
    base = make(target, None, **SMALL)
    assert [o.token_ids for o in got] == [o.token_ids for o in generate(base, PROMPTS, PARAMS)]
