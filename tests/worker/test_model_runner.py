"""End-to-end runner tests on a tiny random Llama: hand-built schedules (prefill, chunked
prefill, decode, preemption with and without kept prefix) must give HF's greedy tokens."""
import pytest
from schedule_driver import ScheduleDriver

from kiln.config import CacheConfig, KilnConfig, ModelConfig, SchedulerConfig
from kiln.executor.uniproc_executor import UniprocExecutor
from kiln.sampling_params import SamplingParams

from checkpoints import hf_greedy, random_prompts

BS = 4
NEW_TOKENS = 8


def make_executor(model_dir, **sched):
    cfg = KilnConfig(
        model_config=ModelConfig(model=str(model_dir), dtype="float32", max_model_len=128),
        cache_config=CacheConfig(block_size=BS, kv_cache_memory=0.002),
        scheduler_config=SchedulerConfig(max_num_seqs=sched.get("max_num_seqs", 4),
                                         max_num_batched_tokens=64),
        enforce_eager=True)
    ex = UniprocExecutor(cfg)
    ex.initialize_cache(ex.determine_num_blocks())
    ex.compile_or_warm_up_model()
    return ex


@pytest.fixture(scope="module")
def executor(tiny_llama_dir):
    ex = make_executor(tiny_llama_dir)
    yield ex
    ex.shutdown()


@pytest.fixture(scope="module")
def prompts_and_oracle(tiny_llama_dir):
    prompts = random_prompts(3, [5, 11, 17])
    return prompts, hf_greedy(tiny_llama_dir, prompts, NEW_TOKENS)


def test_cache_sized_and_assigned(executor):
    worker = executor.worker
    num_blocks = worker.num_blocks
    # 2 layers * 2 (K, V) * 4 tokens * 2 kv heads * 16 dims * 4 bytes
    assert worker.kv_cache_block_bytes() == 2 * 2 * BS * 2 * 16 * 4
    sched, model = executor.kiln_config.scheduler_config, executor.kiln_config.model_config
    cap = 2 * sched.max_num_seqs * -(-model.max_model_len // BS)
    assert num_blocks == min(int(0.002 * (1 << 30)) // worker.kv_cache_block_bytes(), cap)
    layers = worker.model_runner.attention_layers
    assert len(layers) == 2
    for layer in layers.values():
        assert tuple(layer.kv_cache.shape) == (2, num_blocks, BS, 2, 16)


@pytest.mark.parametrize("pad", [0, 3], ids=["exact", "padded"])
def test_chunked_prefill_decode_matches_hf(executor, prompts_and_oracle, monkeypatch, pad):
    prompts, expected = prompts_and_oracle
    runner = executor.worker.model_runner
    # The CUDA graph helper pads the token count; padding tokens must not disturb results.
    monkeypatch.setattr(runner, "padded_num_tokens", lambda n: min(n + pad, runner.max_num_tokens))
    seen, run_model = [], runner._run_model

    def spy(input_ids, positions, attn_metadata, num_tokens):
        seen.append((num_tokens, attn_metadata.num_actual_tokens, input_ids.shape[0]))
        return run_model(input_ids, positions, attn_metadata, num_tokens)

    monkeypatch.setattr(runner, "_run_model", spy)
    drv = ScheduleDriver(executor, BS)
    for rid, p in zip("abc", prompts):
        drv.add(rid, p, SamplingParams(temperature=0, max_tokens=NEW_TOKENS))
    # a: whole prompt; b and c: first chunks only (they must sample nothing).
    got = drv.step({"a": 5, "b": 6, "c": 8})
    assert got["b"] == [] and got["c"] == [] and len(got["a"]) == 1
    got = drv.step({"a": 1, "b": 5, "c": 7})  # b completes its prompt, c still short
    assert len(got["b"]) == 1 and got["c"] == []
    drv.step({"a": 1, "b": 1, "c": 2})  # decode + c's last chunk
    while any(len(drv.reqs[r].outputs) < NEW_TOKENS for r in list(drv.reqs)):
        plan = {r: 1 for r, q in drv.reqs.items() if len(q.outputs) < NEW_TOKENS}
        for r in [r for r in drv.reqs if r not in plan]:
            drv.finish(r)
        drv.step(plan)
    assert [drv.tokens(r) for r in "abc"] == expected
    assert seen[0] == (5 + 6 + 8 + pad, 5 + 6 + 8, 5 + 6 + 8 + pad)
    drv.finish_all()
    assert executor.worker.model_runner.requests == {}


def test_preemption_resumes_identically(executor, prompts_and_oracle):
    prompts, expected = prompts_and_oracle
    drv = ScheduleDriver(executor, BS)
    for rid, p in zip("xyz", prompts):
        drv.add(rid, p, SamplingParams(temperature=0, max_tokens=NEW_TOKENS))
    drv.step({r: len(p) for r, p in zip("xyz", prompts)})
    drv.step({"x": 1, "y": 1, "z": 1})
    drv.preempt("y", keep_prefix=False)  # recompute from scratch
    drv.preempt("z", keep_prefix=True)  # prefix blocks survive (like a prefix-cache hit)
    drv.step({"x": 1})
    drv.step({"x": 1, "y": drv.reqs["y"].num_tokens,
              "z": drv.reqs["z"].num_tokens - drv.reqs["z"].num_computed})
    while any(len(q.outputs) < NEW_TOKENS for q in drv.reqs.values()):
        drv.step({r: 1 for r, q in drv.reqs.items() if len(q.outputs) < NEW_TOKENS})
    assert [drv.reqs[r].outputs[:NEW_TOKENS] for r in "xyz"] == expected
    drv.finish_all()


def test_logprobs_and_seeded_sampling_through_runner(executor, prompts_and_oracle):
    prompts, expected = prompts_and_oracle
    seeded = SamplingParams(temperature=1.0, seed=7, max_tokens=4)

    def run(extra: bool):
        drv = ScheduleDriver(executor, BS)
        drv.add("s", prompts[0], seeded)
        drv.add("g", prompts[1], SamplingParams(temperature=0, logprobs=2))
        if extra:
            drv.add("o", prompts[2], SamplingParams(temperature=0.8, seed=1))
        for _ in range(4):
            plan = {r: q.num_tokens - q.num_computed for r, q in drv.reqs.items()}
            drv.step(plan)
        drv.finish_all()
        return drv

    alone, crowd = run(False), run(True)
    assert alone.reqs == {}  # all finished
    first = alone.outputs[0]
    assert first.sampled_token_ids[1] == [expected[1][0]]
    lp = first.logprobs["g"]
    assert lp.token_ids[0] == expected[1][0] and lp.sampled_rank == 1
    assert lp.token_ids[1] == lp.token_ids[0] and len(lp.token_ids) == 3
    assert lp.logprobs[1] >= lp.logprobs[2]
    def tokens(d):
        return [o.sampled_token_ids[o.req_ids.index("s")][0] for o in d.outputs[:4]]

    assert tokens(alone) == tokens(crowd)


def test_a_step_undone_after_its_draws_leaves_seeded_streams_unchanged(tiny_llama_dir,
                                                                        inprocess_core,
                                                                        monkeypatch):
    """A step that raised after the sampler drew (Ctrl-C while another request's prompt
    logprobs were computed) is undone and recomputed; the seeded request's generator kept the
    lost draw, so its later tokens differed from a run without the failure (helper-21)."""
    import kiln.worker.step_sampling as step_sampling
    from kiln import LLM

    scoring = step_sampling.compute_prompt_logprobs

    def run(interrupt: bool) -> list[int]:
        engine = LLM(model=str(tiny_llama_dir), enforce_eager=True, dtype="float32",
                     max_model_len=128).llm_engine
        fired = []

        def interrupted(*args, **kwargs):
            if interrupt and not fired:
                fired.append(True)
                raise KeyboardInterrupt
            return scoring(*args, **kwargs)

        monkeypatch.setattr(step_sampling, "compute_prompt_logprobs", interrupted)
        engine.add_request("seeded", {"prompt_token_ids": list(range(10, 40))},
                           SamplingParams(temperature=1.0, seed=1234, max_tokens=8,
                                          ignore_eos=True))
        tokens = []
        for step in range(20):
            if step == 2:  # it shares the next step with a prompt-logprobs request
                engine.add_request("scored", {"prompt_token_ids": list(range(50, 90))},
                                   SamplingParams(temperature=0, max_tokens=1,
                                                  prompt_logprobs=1))
            if not engine.has_unfinished_requests():
                break
            try:
                outputs = engine.step()
            except KeyboardInterrupt:
                continue
            tokens += [t for o in outputs if o.request_id == "seeded"
                       for t in o.outputs[0].token_ids]
        engine.shutdown()
        assert fired == ([True] if interrupt else [])
        return tokens

    assert run(True) == run(False)
