"""Sleep mode and the RL weight hooks on an in-process engine (so the worker's tensors can be
looked at): sleep frees the KV cache for real and wake_up gives the same greedy tokens; level 2
discards the weights until they are loaded again; collective_rpc("load_weights") updates the
model in place to another checkpoint's weights (HF on that checkpoint is the oracle), the
prefix cache and the oneDNN-packed copies included."""
import gc
import threading
import weakref

import pytest
import torch
from safetensors.torch import load_file

from kiln import LLM, SamplingParams

from checkpoints import hf_greedy, make_tiny_checkpoint, random_prompts

PROMPTS = random_prompts(2, [5, 19], seed=4)
NEW = 6


def _tokens(llm):
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def other_llama_dir(tmp_path_factory):
    """A second checkpoint of tiny_llama's shapes, other weights."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("other_llama"), "llama", tie=False,
                                seed=1)


@pytest.fixture(scope="module")
def llm(tiny_llama_dir, inprocess_core):
    llm = LLM(model=str(tiny_llama_dir), dtype="float32", enforce_eager=True,
              enable_sleep_mode=True, max_model_len=64, kv_cache_memory=0.01)
    yield llm
    llm.shutdown()


@pytest.fixture(scope="module")
def tiny_tokens(tiny_llama_dir):
    return hf_greedy(tiny_llama_dir, PROMPTS, NEW)


def _worker(llm):
    return llm.llm_engine.engine_core.executor.worker


def test_level1_frees_the_kv_cache_and_wakes_to_the_same_tokens(llm, tiny_tokens):
    assert _tokens(llm) == tiny_tokens
    layers = _worker(llm).model_runner.attention_layers.values()
    caches = [weakref.ref(layer.kv_cache) for layer in layers]
    weight = _worker(llm).get_model().model.norm.weight
    llm.sleep(level=1)
    gc.collect()
    assert llm.is_sleeping()
    assert all(layer.kv_cache is None for layer in layers)
    assert all(ref() is None for ref in caches)  # nothing holds the freed caches
    assert weight.untyped_storage().nbytes() > 0  # level 1 keeps the weights
    with pytest.raises(RuntimeError, match=r"sleeping.*wake_up\(\)"):
        _tokens(llm)
    llm.wake_up()
    assert not llm.is_sleeping()
    assert _tokens(llm) == tiny_tokens


def test_level1_wakes_a_model_whose_dense_copies_were_let_go(tiny_llama_dir, inprocess_core):
    """Online int8 (rotated, as by default) lets the float weights go at load (meta tensors):
    wake_up copied them back and failed (NotImplementedError: meta tensor), as a GGUF model's
    let-go dense copies would; level 2 stays refused on it."""
    llm = LLM(model=str(tiny_llama_dir), dtype="bfloat16", quantization="int8",
              enforce_eager=True, enable_sleep_mode=True, max_model_len=64,
              kv_cache_memory=0.01)
    try:
        assert any(p.is_meta for p in _worker(llm).get_model().parameters())
        before = _tokens(llm)
        llm.sleep(level=1)
        llm.wake_up()
        assert not llm.is_sleeping()
        assert _tokens(llm) == before
        with pytest.raises(Exception, match="quantized"):
            llm.sleep(level=2)
        assert _tokens(llm) == before
    finally:
        llm.shutdown()


def test_level2_discards_the_weights_until_they_are_loaded(llm, tiny_llama_dir, tiny_tokens):
    weight = _worker(llm).get_model().model.norm.weight
    llm.sleep(level=2)
    assert weight.untyped_storage().nbytes() == 0
    llm.wake_up(tags=["weights"])
    with pytest.raises(RuntimeError, match="sleeping"):
        _tokens(llm)
    # a partial load leaves the engine unable to step, saying so
    part = load_file(str(tiny_llama_dir / "model.safetensors"))
    llm.collective_rpc("load_weights", kwargs={"weights": [("model.norm.weight",
                                                            part["model.norm.weight"])]})
    llm.wake_up(tags=["kv_cache"])
    assert not llm.is_sleeping()
    with pytest.raises(RuntimeError, match="weight.*discarded by sleep.*reload_weights"):
        _tokens(llm)
    llm.collective_rpc("reload_weights")
    assert _tokens(llm) == tiny_tokens


def test_load_weights_updates_in_place_to_another_checkpoint(llm, tiny_llama_dir,
                                                            other_llama_dir, tiny_tokens):
    model = _worker(llm).get_model()
    qkv = model.model.layers[0].self_attn.qkv_proj
    packed_before = qkv.cpu_packed
    assert _tokens(llm) == tiny_tokens  # the prompts' blocks are in the prefix cache now
    new = load_file(str(other_llama_dir / "model.safetensors"))
    loaded = llm.collective_rpc("load_weights", kwargs={"weights": list(new.items())})[0]
    assert "model.layers.0.self_attn.qkv_proj.weight#q" in loaded
    if packed_before is not None:  # oneDNN packs float32 weights here: packed again
        assert qkv.cpu_packed is not packed_before
    assert _tokens(llm) == hf_greedy(other_llama_dir, PROMPTS, NEW)
    # back, by name and dict, as trainers send them
    old = load_file(str(tiny_llama_dir / "model.safetensors"))
    llm.collective_rpc("load_weights", args=(old,))
    assert _tokens(llm) == tiny_tokens


def test_an_update_failing_part_way_leaves_what_it_wrote_packed_too(llm, tiny_llama_dir,
                                                                     other_llama_dir,
                                                                     tiny_tokens):
    """load_weights raising at a name no parameter has, after every weight before it was
    written: the model is the one those weights make (each packed copy redone), not the old
    packed copies beside the new weights (its tokens were neither checkpoint's)."""
    new = load_file(str(other_llama_dir / "model.safetensors"))
    try:
        with pytest.raises(ValueError, match="model.layers.9.x.weight"):
            llm.collective_rpc("load_weights", kwargs={"weights": [
                *new.items(), ("model.layers.9.x.weight", torch.zeros(2))]})
        assert _tokens(llm) == hf_greedy(other_llama_dir, PROMPTS, NEW)
    finally:
        llm.collective_rpc("load_weights", args=(load_file(str(tiny_llama_dir /
                                                                "model.safetensors")),))
    assert _tokens(llm) == tiny_tokens


def _norm_sum(worker, scale):
    return float(worker.get_model().model.norm.weight.sum()) * scale


def test_collective_rpc_runs_callables_and_names_bad_calls(llm):
    assert llm.collective_rpc(_norm_sum, args=(0.0,)) == [0.0]
    assert llm.collective_rpc(lambda worker: worker.rank) == [0]  # in-process: any callable
    with pytest.raises(ValueError, match="no method 'nope'"):
        llm.collective_rpc("nope")
    with pytest.raises(ValueError, match="model.layers.9.x.weight"):
        llm.collective_rpc("load_weights", args=([("model.layers.9.x.weight",
                                                   torch.zeros(2))],))
    with pytest.raises(ValueError, match=r"\(name, tensor\) pairs"):
        llm.collective_rpc("load_weights", args=([("model.norm.weight", [1.0])],))
    with pytest.raises(ValueError, match="call the engine's sleep"):
        llm.collective_rpc("sleep", args=(1,))
    assert not llm.is_sleeping()


def test_collective_rpc_past_its_timeout_raises_and_the_engine_waits_for_it(llm, tiny_tokens):
    """vLLM's TimeoutError naming the method and the timeout; the call runs on, and nothing
    else runs on the engine until it ends."""
    release = threading.Event()

    def held(worker):
        release.wait()
        return worker.rank

    with pytest.raises(TimeoutError, match=r"'.*held' did not finish within its timeout of "
                                           r"0\.05 s"):
        llm.collective_rpc(held, timeout=0.05)
    release.set()
    assert llm.collective_rpc(held, timeout=60) == [0]
    assert _tokens(llm) == tiny_tokens
    for bad in (0, -1.0, float("nan"), "5", True):
        with pytest.raises(ValueError, match="collective_rpc timeout must be a number"):
            llm.collective_rpc("weights_missing", timeout=bad)


def test_collective_rpc_timeout_counts_an_earlier_late_call(llm, tiny_tokens):
    """A call made while an earlier one runs past its timeout times out too (as the core's
    process answers it): it waited for the earlier call with no limit. It runs after it."""
    release, ran = threading.Event(), []

    def held(worker):
        release.wait()

    def after(worker):
        ran.append(release.is_set())

    with pytest.raises(TimeoutError, match="held"):
        llm.collective_rpc(held, timeout=0.05)
    unblock = threading.Timer(30, release.set)  # without the bound, the second call waited
    unblock.start()
    try:
        with pytest.raises(TimeoutError, match="after' did not finish"):
            llm.collective_rpc(after, timeout=0.05)
        assert not release.is_set() and ran == []
    finally:
        release.set()
        unblock.cancel()
    assert _tokens(llm) == tiny_tokens  # the engine waits for both
    assert ran == [True]


def test_sleep_abort_reports_the_requests_it_ended(llm, tiny_tokens):
    """In-process, the engine steps only while the core has requests: those a sleep ended
    (finish_reason "abort") must still come out, or a server's streams hang."""
    engine = llm.llm_engine
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"sleep-abort-{i}", {"prompt_token_ids": prompt}, params)
    engine.step()
    llm.sleep(level=1, mode="abort")
    outs = engine.step()
    assert sorted((o.request_id, o.finished, o.outputs[0].finish_reason) for o in outs) == [
        (f"sleep-abort-{i}", True, "abort") for i in range(len(PROMPTS))]
    assert not engine.has_unfinished_requests()
    llm.wake_up()
    assert _tokens(llm) == tiny_tokens


def _acceptance(llm, before: dict) -> tuple[int, int]:
    """(accepted, drafted) since the engine stats `before`."""
    after = llm.llm_engine.get_stats()
    return tuple(after[f"spec_decode_num_{k}_tokens"] - before[f"spec_decode_num_{k}_tokens"]
                 for k in ("accepted", "draft"))


def _tokens_and_acceptance(llm):
    before = llm.llm_engine.get_stats()
    tokens = _tokens(llm)
    return tokens, _acceptance(llm, before)


def test_a_draft_model_sleeps_wakes_and_updates_with_the_target(
        tiny_llama_dir, other_llama_dir, inprocess_core, tiny_tokens):
    """Speculative decoding with a draft model (the target's own checkpoint: every draft
    accepted): its KV tensors are freed with the target's, level 1 keeps and level 2 discards
    its weights too (as vLLM's allocator does), and after wake_up its acceptance is what it was
    before the sleep. The engine waits for the draft's weights as for the target's;
    load_weights(model="draft") updates the draft, reload_weights reads both checkpoints."""
    spec = {"method": "draft_model", "model": str(tiny_llama_dir), "num_speculative_tokens": 2}
    llm = LLM(model=str(tiny_llama_dir), dtype="float32", enforce_eager=True,
              enable_sleep_mode=True, max_model_len=64, kv_cache_memory=0.01,
              speculative_config=spec)
    drafter = _worker(llm).model_runner.drafter
    layers = list(drafter.attention_layers.values())
    draft_weight = drafter.model.model.norm.weight
    tokens, (accepted, drafted) = _tokens_and_acceptance(llm)
    assert tokens == tiny_tokens and drafted > 0 and accepted == drafted
    old = load_file(str(tiny_llama_dir / "model.safetensors"))
    for level in (1, 2):
        llm.sleep(level=level)
        assert all(layer.kv_cache is None for layer in layers)
        assert (draft_weight.untyped_storage().nbytes() == 0) == (level == 2)
        llm.wake_up()
        if level == 2:  # the target's weights alone: the draft's still to load
            llm.collective_rpc("load_weights", kwargs={"weights": list(old.items())})
            assert sum(llm.collective_rpc("weights_missing")) > 0
            with pytest.raises(RuntimeError, match="discarded by sleep.*'model': 'draft'"):
                _tokens(llm)
            llm.collective_rpc("load_weights", kwargs={"weights": list(old.items()),
                                                       "model": "draft"})
        assert _tokens_and_acceptance(llm) == (tiny_tokens, (accepted, drafted))
    # an update reaches the model it names: the target alone leaves a stale draft (fewer
    # accepted), the draft too brings every draft back
    new = load_file(str(other_llama_dir / "model.safetensors"))
    want = hf_greedy(other_llama_dir, PROMPTS, NEW)
    llm.collective_rpc("load_weights", kwargs={"weights": list(new.items())})
    tokens, (stale, tried) = _tokens_and_acceptance(llm)
    assert tokens == want and stale < tried
    llm.collective_rpc("load_weights", kwargs={"weights": list(new.items()), "model": "draft"})
    tokens, (fresh, n) = _tokens_and_acceptance(llm)
    assert tokens == want and n > 0 and fresh == n
    # level 2 then reload_weights: both read from their checkpoints again
    llm.sleep(level=2)
    llm.wake_up()
    llm.collective_rpc("reload_weights")
    assert _tokens_and_acceptance(llm) == (tiny_tokens, (accepted, drafted))
    with pytest.raises(ValueError, match="model must be one of"):
        llm.collective_rpc("reload_weights", kwargs={"model": "drafter"})
    llm.shutdown()
