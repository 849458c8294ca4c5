"""--scheduling-policy priority on a real tiny Llama under KV-cache pressure: the urgent requests
(submitted last) finish first, only less urgent ones are preempted, and every output is still HF
transformers' greedy continuation (a preempted request is recomputed)."""
import pytest

from kiln import LLM, SamplingParams

pytestmark = pytest.mark.usefixtures("inprocess_core")  # reads the scheduler

# Submitted in this order; the urgent (0) ones last, so fcfs would serve them last.
PRIORITIES = [3, 2, 3, 1, 0, 0]
MAX_TOKENS = 12


def _run(model_dir, prompts, policy):
    # 16 blocks of 4: three 20-token prompts (5 blocks each) fit, and they outgrow the cache
    # while decoding (32 tokens = 8 blocks each).
    llm = LLM(model=str(model_dir), dtype="float32", enforce_eager=True, max_model_len=64,
              block_size=4, num_gpu_blocks_override=16, max_num_seqs=4,
              max_num_batched_tokens=16, enable_prefix_caching=False,
              scheduling_policy=policy)
    scheduler = llm.llm_engine.engine_core.core.scheduler
    finished, preempted = [], []
    release, preempt = scheduler._release, scheduler._preempt

    def spy_release(request):
        finished.append(int(request.request_id))
        release(request)

    def spy_preempt(request):
        preempted.append(int(request.request_id))
        preempt(request)

    scheduler._release, scheduler._preempt = spy_release, spy_preempt
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                        priority=PRIORITIES)
    llm.shutdown()
    return [list(o.outputs[0].token_ids) for o in outs], finished, preempted


def test_urgent_requests_finish_first_and_outputs_match_hf(tiny_llama_dir):
    from checkpoints import hf_greedy, random_prompts

    prompts = random_prompts(len(PRIORITIES), [20], seed=3)
    expected = hf_greedy(tiny_llama_dir, prompts, MAX_TOKENS)

    tokens, finished, preempted = _run(tiny_llama_dir, prompts, "priority")
    assert tokens == expected
    # The request ids are the prompts' indices: finished in (priority, arrival) order.
    assert finished == sorted(range(len(PRIORITIES)), key=lambda i: (PRIORITIES[i], i))
    assert preempted and all(PRIORITIES[i] > 0 for i in preempted)

    tokens, finished, preempted = _run(tiny_llama_dir, prompts, "fcfs")
    assert tokens == expected  # fcfs ignores the priorities, as vLLM V1 does
    assert finished[:2] == [0, 1] and finished[-2:] == [4, 5]
    assert preempted
