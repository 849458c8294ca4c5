"""LoRA serving (kiln/lora/) against HF transformers on the MERGED weights (W + scale * B @ A):
a batch mixing the base model and two adapters, max_loras=1 with two adapters (the scheduler
keeps a batch within the slots), prefix caching kept apart per adapter, mode 3, refusals."""
import pytest
import torch
from lora_adapters import token_logprobs

from kiln.entrypoints.llm import LLM
from kiln.sampling_params import SamplingParams

from .test_lora_add_op import count_unique

MAX_TOKENS = 6

pytestmark = pytest.mark.usefixtures("inprocess_core")  # no core process to start per engine


def _run(llm, prompts, loras, **kw):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, **kw)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                        lora_request=loras)


def _mixed(lora_setup):
    """Each prompt under the base model, a1 and a2, interleaved in one batch."""
    names = [None, "a1", "a2"]
    prompts, loras, expected = [], [], []
    for i, prompt in enumerate(lora_setup["prompts"]):
        for j in range(3):
            name = names[(i + j) % 3]
            prompts.append(prompt)
            loras.append(None if name is None else lora_setup["loras"][name])
            expected.append(lora_setup["refs"][name][i])
    return prompts, loras, expected


def test_mixed_batch_matches_hf_on_merged_weights(lora_setup, monkeypatch):
    llm = LLM(str(lora_setup["base"]), enforce_eager=True, enable_lora=True, max_loras=2,
              max_lora_rank=8, max_model_len=128)
    prompts, loras, expected = _mixed(lora_setup)
    calls = count_unique(monkeypatch)
    outs = _run(llm, prompts, loras, logprobs=0)
    assert calls == []  # the CPU provider reads the step's slots, published once per step
    assert [o.outputs[0].token_ids for o in outs] == expected
    assert [o.lora_request for o in outs] == loras  # vLLM's field
    assert [o.outputs[0].lora_request for o in outs] == loras
    # logprobs close to HF's on the merged checkpoint (a2: rsLoRA scaling)
    for out, prompt, lora in zip(outs, prompts, loras):
        model = lora_setup["models"][None if lora is None else lora.lora_name]
        got = [next(iter(step.values())).logprob for step in out.outputs[0].logprobs]
        want = token_logprobs(model, prompt, list(out.outputs[0].token_ids))
        assert got == pytest.approx(want, abs=2e-4)
    # each alone gives the same tokens as in the mixed batch
    for name in ("a1", "a2"):
        alone = _run(llm, lora_setup["prompts"], lora_setup["loras"][name])
        assert [o.outputs[0].token_ids for o in alone] == lora_setup["refs"][name]
    llm.shutdown()


def test_one_slot_two_adapters_and_prefix_cache_kept_apart(lora_setup):
    """max_loras=1: the scheduler runs one adapter's requests at a time (the manager raises if a
    step needs two), max_cpu_loras=1 reloads an evicted adapter from disk; a prompt cached
    under one adapter is never a hit for another or for the base model."""
    llm = LLM(str(lora_setup["base"]), enforce_eager=True, enable_lora=True, max_loras=1,
              max_cpu_loras=1, max_lora_rank=8, max_model_len=128, block_size=4)
    prompts, loras, expected = _mixed(lora_setup)
    outs = _run(llm, prompts, loras)
    assert [o.outputs[0].token_ids for o in outs] == expected
    llm.reset_prefix_cache()
    long = lora_setup["prompts"][2]  # 21 tokens: 5 full blocks
    first = _run(llm, [long], lora_setup["loras"]["a1"])[0]
    again = _run(llm, [long], lora_setup["loras"]["a1"])[0]
    other = _run(llm, [long], lora_setup["loras"]["a2"])[0]
    base = _run(llm, [long], None)[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 20
    assert other.num_cached_tokens == 0 and base.num_cached_tokens == 0
    assert list(other.outputs[0].token_ids) == lora_setup["refs"]["a2"][2]
    assert list(base.outputs[0].token_ids) == lora_setup["refs"][None][2]
    llm.shutdown()


def test_mode3_graph_serves_every_adapter_mix(lora_setup, monkeypatch):
    """The op traces into the piecewise graph (fullgraph: no breaks); one graph serves any mix,
    the slot indices and adapter weights being runtime inputs (the step's slots too, published
    once per step for the graph's opaque CPU op)."""
    llm = LLM(str(lora_setup["base"]), enable_lora=True, max_loras=2, max_lora_rank=8,
              max_model_len=128, compilation_config={"mode": 3, "backend": "eager"})
    prompts, loras, expected = _mixed(lora_setup)
    calls = count_unique(monkeypatch)
    assert [o.outputs[0].token_ids for o in _run(llm, prompts, loras)] == expected
    alone = _run(llm, lora_setup["prompts"], lora_setup["loras"]["a2"])
    assert [o.outputs[0].token_ids for o in alone] == lora_setup["refs"]["a2"]
    assert calls == []
    llm.shutdown()


def test_lora_request_without_enable_lora_is_refused_by_name(lora_setup):
    llm = LLM(str(lora_setup["base"]), enforce_eager=True, max_model_len=64, max_lora_rank=16)
    with pytest.raises(ValueError, match="--enable-lora"):
        _run(llm, lora_setup["prompts"][:1], lora_setup["loras"]["a1"])
    llm.shutdown()


def test_pipeline_parallel_and_fully_sharded_are_refused_clearly(lora_setup):
    from kiln.engine.arg_utils import EngineArgs

    with pytest.raises(ValueError, match="--enable-lora.*--pipeline-parallel-size"):
        EngineArgs(model=str(lora_setup["base"]), enable_lora=True, pipeline_parallel_size=2,
                   distributed_executor_backend="mp").create_kiln_config()
    with pytest.raises(ValueError, match="--fully-sharded-loras is not supported"):
        EngineArgs(model=str(lora_setup["base"]), enable_lora=True,
                   fully_sharded_loras=True).create_kiln_config()


def test_adapter_deleted_after_the_check_ends_only_its_requests(lora_setup, tmp_path):
    """The front end checked the adapter; its files go before the core reloads it (evicted
    with max_cpu_loras=1): its requests end with the error, the base model's in the same
    batch finish, and the engine serves on (the core used to die)."""
    import shutil

    from kiln.lora.request import LoRARequest

    copy = shutil.copytree(lora_setup["adapters"]["a1"], tmp_path / "a1")
    gone = LoRARequest("gone", 7, str(copy))
    llm = LLM(str(lora_setup["base"]), enforce_eager=True, enable_lora=True, max_loras=1,
              max_cpu_loras=1, max_lora_rank=8, max_model_len=128)
    prompt = lora_setup["prompts"][0]
    assert _run(llm, [prompt], gone)[0].outputs[0].token_ids == lora_setup["refs"]["a1"][0]
    _run(llm, [prompt], lora_setup["loras"]["a2"])  # evicts `gone` from host memory
    shutil.rmtree(copy)
    failed, base = _run(llm, [prompt, prompt], [gone, None])
    assert failed.outputs[0].finish_reason == "abort" and "not a directory" in failed.outputs[0].error
    assert list(base.outputs[0].token_ids) == lora_setup["refs"][None][0]
    again = _run(llm, [prompt], lora_setup["loras"]["a2"])[0]
    assert list(again.outputs[0].token_ids) == lora_setup["refs"]["a2"][0]
    llm.shutdown()


def test_a_request_for_another_adapter_does_not_starve(lora_setup):
    """max_loras=1, a1 running and one a1 request arriving every step: the a2 request queued
    among them runs (a1's stream used to keep the slot for ever)."""
    from kiln.engine.arg_utils import EngineArgs
    from kiln.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineArgs(model=str(lora_setup["base"]), enforce_eager=True,
                                  enable_lora=True, max_loras=1, max_lora_rank=8,
                                  max_model_len=128).create_kiln_config())
    a1, a2 = lora_setup["loras"]["a1"], lora_setup["loras"]["a2"]
    prompt = lora_setup["prompts"][0]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    engine.add_request("a1-0", {"prompt_token_ids": prompt, "lora_request": a1}, params)
    engine.step()
    engine.add_request("a2", {"prompt_token_ids": prompt, "lora_request": a2}, params)
    finished = {}
    for step in range(1, 200):
        engine.add_request(f"a1-{step}", {"prompt_token_ids": prompt, "lora_request": a1},
                           params)
        finished.update({o.request_id: o for o in engine.step() if o.finished})
        if "a2" in finished:
            break
    assert list(finished["a2"].outputs[0].token_ids) == lora_setup["refs"]["a2"][0]
    assert list(finished["a1-0"].outputs[0].token_ids) == lora_setup["refs"]["a1"][0]
    engine.shutdown()


def test_a_cache_salt_cannot_spell_an_adapter_into_the_prefix_cache(lora_setup):
    """The root block hash joined salt and adapter by text: a base-model request whose
    cache_salt ended in the adapter's key hit the blocks that adapter computed (and answered
    with the adapter's K/V)."""
    llm = LLM(str(lora_setup["base"]), enforce_eager=True, enable_lora=True, max_lora_rank=8,
              max_model_len=128, block_size=4)
    a1, long = lora_setup["loras"]["a1"], lora_setup["prompts"][2]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": long, "cache_salt": "s"}], params, use_tqdm=False,
                 lora_request=a1)
    salt = "s|" + a1.hash_key().decode()
    base = llm.generate([{"prompt_token_ids": long, "cache_salt": salt}], params,
                        use_tqdm=False)[0]
    assert base.num_cached_tokens == 0
    assert list(base.outputs[0].token_ids) == lora_setup["refs"][None][2]
    llm.shutdown()


def test_engine_add_request_and_async_generate_take_lora_request(lora_setup):
    """vLLM's multilora example: LLMEngine.add_request(id, prompt, params,
    lora_request=...), and AsyncLLM.generate(..., lora_request=...) (a TypeError before)."""
    import asyncio

    from kiln.engine.arg_utils import EngineArgs
    from kiln.engine.async_llm import AsyncLLM
    from kiln.engine.llm_engine import LLMEngine

    args = EngineArgs(model=str(lora_setup["base"]), enforce_eager=True, enable_lora=True,
                      max_lora_rank=8, max_model_len=128)
    engine = LLMEngine(args.create_kiln_config())
    prompt = {"prompt_token_ids": lora_setup["prompts"][0]}
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    engine.add_request("r", prompt, params, lora_request=lora_setup["loras"]["a2"])
    # vLLM's lora_requests_info labels (kiln:lora_requests_info on /metrics)
    stats = engine.get_stats()
    assert (stats["waiting_lora_adapters"], stats["running_lora_adapters"]) == (["a2"], [])
    engine.step()
    stats = engine.get_stats()
    assert (stats["waiting_lora_adapters"], stats["running_lora_adapters"]) == ([], ["a2"])
    finished = []
    while engine.has_unfinished_requests():
        finished += [o for o in engine.step() if o.finished]
    assert list(finished[0].outputs[0].token_ids) == lora_setup["refs"]["a2"][0]
    assert finished[0].lora_request == lora_setup["loras"]["a2"]  # vLLM's field
    engine.shutdown()

    async def run():
        llm = AsyncLLM(LLMEngine(args.create_kiln_config()))
        try:
            outs = [out async for out in llm.generate(prompt, params, "q",
                                                      lora_request=lora_setup["loras"]["a1"])]
            return list(outs[-1].outputs[0].token_ids)
        finally:
            llm.shutdown()

    assert asyncio.run(run()) == lora_setup["refs"]["a1"][0]


def test_lora_dtype_holds_adapters_in_that_dtype(lora_setup):
    """vLLM's --lora-dtype: a float32 model with bfloat16 adapters (the delta is computed in
    theirs and added in the model's); logprobs stay near HF's on the merged float32 weights."""
    llm = LLM(str(lora_setup["base"]), enforce_eager=True, enable_lora=True, max_lora_rank=8,
              max_model_len=128, lora_dtype="bfloat16")
    runner = llm.llm_engine.engine_core.executor.worker.model_runner
    layer = next(iter(runner.lora_manager.layers.values()))
    assert layer.lora_a.dtype == layer.lora_b.dtype == torch.bfloat16
    prompt, a2 = lora_setup["prompts"][0], lora_setup["loras"]["a2"]
    out = _run(llm, [prompt], a2, logprobs=0)[0].outputs[0]
    got = [next(iter(step.values())).logprob for step in out.logprobs]
    want = token_logprobs(lora_setup["models"]["a2"], prompt, list(out.token_ids))
    assert got == pytest.approx(want, abs=0.05)
    llm.shutdown()


def _adapter_matches_hf(model_dir, adapter, name: str) -> None:
    """The adapter's greedy tokens and logprobs equal HF's on the merged weights, and differ
    from the base model's."""
    from lora_adapters import greedy, merged_model

    from kiln.lora.request import LoRARequest

    from checkpoints import random_prompts

    prompts = random_prompts(2, [5, 21], seed=3)
    merged = merged_model(model_dir, adapter)
    want = greedy(merged, prompts, MAX_TOKENS)
    llm = LLM(str(model_dir), enforce_eager=True, enable_lora=True, max_lora_rank=8,
              max_model_len=128, kv_cache_memory=0.02)
    outs = _run(llm, prompts, LoRARequest(name, 1, str(adapter)), logprobs=0)
    base = _run(llm, prompts, None)
    llm.shutdown()
    assert [o.outputs[0].token_ids for o in outs] == want
    assert want != [o.outputs[0].token_ids for o in base]  # the adapter changes the answer
    for out, prompt, tokens in zip(outs, prompts, want):
        got = [next(iter(step.values())).logprob for step in out.outputs[0].logprobs]
        assert got == pytest.approx(token_logprobs(merged, prompt, tokens), abs=2e-4)


def test_phi3_adapter_of_fused_projections_matches_hf(tiny_phi3_dir, tmp_path):
    """PEFT's Phi-3 adapters target the checkpoint's fused qkv_proj / gate_up_proj (one A, B
    over every part's rows): they were refused as 'not a q/k/v/o/gate/up/down projection'.
    HF's Phi-3 has the fused modules too."""
    from lora_adapters import write_adapter

    adapter = write_adapter(tmp_path / "phi3_lora", tiny_phi3_dir,
                            targets=("qkv_proj", "o_proj", "gate_up_proj", "down_proj"))
    _adapter_matches_hf(tiny_phi3_dir, adapter, "fused")


@pytest.mark.slow
def test_glm4_adapter_of_its_fused_gate_up_matches_hf(tiny_glm4_dir, tmp_path):
    """GLM-4's checkpoint (and HF's module) fuses gate_up_proj, as Phi-3's, beside separate
    q/k/v: PEFT's adapters on them apply as on HF's merged weights."""
    from lora_adapters import write_adapter

    adapter = write_adapter(tmp_path / "glm4_lora", tiny_glm4_dir, targets=(
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj"))
    _adapter_matches_hf(tiny_glm4_dir, adapter, "glm4")


def test_cohere_adapter_matches_hf(tiny_cohere_dir, tmp_path):
    """Command-R's projections are Llama's (q/k/v/o, gate/up/down) in a parallel block: its
    adapters apply as Llama's do."""
    from lora_adapters import write_adapter

    _adapter_matches_hf(tiny_cohere_dir, write_adapter(tmp_path / "cohere_lora",
                                                       tiny_cohere_dir), "cohere")


def test_phi_adapter_of_dense_and_fc_projections_matches_hf(tiny_phi_dir, tmp_path):
    """Phi-1/2's adapters target q/k/v, dense and the non-gated MLP's fc1 / fc2 (its biased
    projections): --enable-lora was refused for PhiForCausalLM."""
    from lora_adapters import PHI_TARGETS, write_adapter

    adapter = write_adapter(tmp_path / "phi_lora", tiny_phi_dir, targets=PHI_TARGETS)
    _adapter_matches_hf(tiny_phi_dir, adapter, "phi")
