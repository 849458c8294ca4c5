"""Hybrid sliding-window models in KV cache groups (kiln/core/kv_cache_groups.py) generating far
past the window on a small cache of blocks of 4: Gemma-2 (window-8 and global layers alternating:
a full group and a window group) and Gemma-3 laid out 5 local : 1 global (a full group and five
window groups of one layer each). The window groups' blocks behind the window go back to the
pool, so each request's window tables hold a bounded number of blocks while its full table holds
every one, three requests (one hitting another's prefix) run side by side without preemption,
tokens equal HF's, and every block is free at the end."""
import pytest

from kiln import LLM, SamplingParams
from kiln.core.kv_cache_utils import cdiv
from kiln.core.sliding_window_blocks import peak_blocks

from checkpoints import hf_greedy, make_tiny_checkpoint, random_prompts

pytestmark = pytest.mark.usefixtures("inprocess_core")  # the scheduler is read in this process

NEW_TOKENS = 40
BUDGET = 16
FIRST = random_prompts(2, [20, 33], seed=7)
PROMPTS = FIRST + [FIRST[0] + [5, 6, 7]]  # the last one hits the first one's blocks


def _generate_in_groups(model_dir, monkeypatch, prefix_caching, backend, layer_groups,
                        num_blocks=80, prompts=PROMPTS, new_tokens=NEW_TOKENS):
    """`layer_groups`: each layer's KV cache group (0: the full one)."""
    monkeypatch.setenv("KILN_ATTENTION_BACKEND", backend)
    llm = LLM(model=str(model_dir), dtype="float32", enforce_eager=True, block_size=4,
              num_gpu_blocks_override=num_blocks, max_model_len=128,
              max_num_batched_tokens=BUDGET, max_num_seqs=4,
              enable_prefix_caching=prefix_caching)
    worker = llm.llm_engine.engine_core.core.executor.worker
    scheduler = llm.llm_engine.engine_core.core.scheduler
    kv = scheduler.kv_cache_manager
    assert kv.group_windows == (None,) + (8,) * (max(layer_groups))
    layers = list(worker.model_runner.attention_layers.values())
    assert [layer.kv_group for layer in layers] == layer_groups
    # one layer per group: one tensor, a block id is one layer's block
    assert all(layer.kv_cache is layers[0].kv_cache for layer in layers)
    held: list[tuple[int, int, int]] = []  # (full blocks, real window blocks, table length)
    schedule = scheduler.schedule

    def recording_schedule():
        out = schedule()
        for full, *windows in kv.req_to_group_blocks.values():
            held.extend((sum(b is not None for b in full), sum(b is not None for b in window),
                         len(full)) for window in windows)
        return out

    scheduler.schedule = recording_schedule
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    # the full group holds every block; the window group a prefill chunk's window at most
    assert all(full == length for full, _, length in held)
    assert max(window for _, window, _ in held) <= peak_blocks(128, BUDGET, 0, 8, 4) == 7
    assert max(full for full, _, _ in held) == cdiv(max(map(len, prompts)) + new_tokens - 1, 4)
    stats = scheduler.make_stats()
    assert stats.num_preemptions == 0
    assert (stats.prefix_cache_hits > 0) == prefix_caching
    assert kv.num_free_blocks == num_blocks
    assert all(b.ref_cnt == 0 for b in kv.block_pool.blocks)
    return tokens


@pytest.fixture(scope="module")
def gemma2_hf_tokens(tiny_gemma2_dir):
    return hf_greedy(tiny_gemma2_dir, PROMPTS, NEW_TOKENS, attn_implementation="eager")


@pytest.mark.parametrize("prefix_caching, backend", [(True, "cpu"), (False, "torch")])
def test_gemma2_window_group_holds_bounded_blocks(tiny_gemma2_dir, gemma2_hf_tokens, monkeypatch,
                                                  prefix_caching, backend):
    # layer 0 windowed, layer 1 global
    assert _generate_in_groups(tiny_gemma2_dir, monkeypatch, prefix_caching, backend,
                               [1, 0]) == gemma2_hf_tokens


def test_gemma3_five_window_groups_hold_bounded_blocks(tmp_path, monkeypatch):
    """Gemma-3's layout, layer 5 global: a request needs its full table and five windows."""
    model_dir = make_tiny_checkpoint(tmp_path, "gemma3", tie=True, num_hidden_layers=6,
                                     sliding_window_pattern=6)
    prompts = PROMPTS[::2]  # one prompt and one hitting its blocks
    tokens = _generate_in_groups(model_dir, monkeypatch, True, "cpu", [1, 2, 3, 4, 5, 0],
                                 num_blocks=120, prompts=prompts, new_tokens=20)
    assert tokens == hf_greedy(model_dir, prompts, 20, attn_implementation="eager")


def test_every_groups_layers_take_the_cpp_kernel(tiny_gemma3_dir, monkeypatch):
    """Prefill and decode steps of a two-group model go to the C++ kernel in every layer, each
    with its group's block table (cpu_backend.group_steps), and give the Python path's tokens
    and logprobs; the Python path alone before (_hand_over off)."""
    from kiln.attention import cpu_backend
    from kiln.native import attention_op

    monkeypatch.setenv("KILN_ATTENTION_BACKEND", "cpu")
    llm = LLM(model=str(tiny_gemma3_dir), dtype="float32", enforce_eager=True, block_size=4,
              num_gpu_blocks_override=40, max_model_len=64, max_num_batched_tokens=16,
              max_num_seqs=4, enable_prefix_caching=False)
    assert llm.llm_engine.engine_core.core.scheduler.kv_cache_manager.group_windows == (None, 8)
    # 12 tokens: a long query (the prefill kernel's), past the window of group 1's layers
    prompts = [{"prompt_token_ids": list(range(5, 17))}, {"prompt_token_ids": [11, 12, 13]}]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, logprobs=2)

    def run() -> tuple[list, dict]:
        before = attention_op.call_counts()
        outs = [o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)]
        return outs, {k: v - before[k] for k, v in attention_op.call_counts().items()}

    fast, counts = run()  # every step is handed over
    assert counts["python"] == 0 and counts["kernel"] >= 2 * 20
    monkeypatch.setattr(cpu_backend, "_hand_over", lambda *args: None)
    slow, counts = run()
    assert counts["kernel"] == 0 and counts["python"] >= 2 * 20
    assert [o.token_ids for o in fast] == [o.token_ids for o in slow]
    for f, s in zip(fast, slow):
        for lf, ls in zip(f.logprobs, s.logprobs):
            assert {t: p.logprob for t, p in lf.items()} == pytest.approx(
                {t: p.logprob for t, p in ls.items()}, abs=1e-6)
