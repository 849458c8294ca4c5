"""LoRA serving (kiln/lora/) against HF transformers on the MERGED weights (W + scale * B @ A):
a batch mixing the base model and two adapters, max_loras=1 with two adapters (the scheduler
keeps a batch within the slots), prefix caching kept apart per adapter, mode 3, refusals."""
import functools

import pytest
import torch
from lora_adapters import merge_adapter, write_adapter

from kiln.entrypoints.llm import LLM
from kiln.lora.request import LoRARequest
from kiln.sampling_params import SamplingParams

from checkpoints import hf_greedy, make_tiny_checkpoint, random_prompts

MAX_TOKENS = 6


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("lora")
    base = make_tiny_checkpoint(d / "base", "llama", tie=False)
    a1 = write_adapter(d / "a1", base, seed=1)  # every projection, r=4
    a2 = write_adapter(d / "a2", base, seed=2, rank=8, alpha=16, use_rslora=True,
                       targets=("q_proj", "v_proj", "gate_proj", "down_proj"))
    prompts = random_prompts(3, [5, 9, 21])
    refs = {None: hf_greedy(base, prompts, MAX_TOKENS)}
    merged = {}
    for name, adapter in (("a1", a1), ("a2", a2)):
        merged[name] = merge_adapter(base, adapter, d / f"merged_{name}")
        refs[name] = hf_greedy(merged[name], prompts, MAX_TOKENS)
    loras = {"a1": LoRARequest("a1", 1, str(a1)), "a2": LoRARequest("a2", 2, str(a2))}
    # the adapters change the answers (else the test proves nothing)
    assert refs["a1"] != refs[None] and refs["a2"] != refs[None] and refs["a1"] != refs["a2"]
    return dict(base=base, prompts=prompts, refs=refs, loras=loras, merged=merged)


@functools.cache
def _hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def _hf_token_logprobs(model_dir, prompt: list[int], tokens: list[int]) -> list[float]:
    hf = _hf_model(model_dir)
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + tokens])).logits[0].float()
    lp = logits.log_softmax(-1)
    return [lp[len(prompt) - 1 + i, t].item() for i, t in enumerate(tokens)]


def _run(llm, prompts, loras, **kw):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, **kw)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                        lora_request=loras)


def _mixed(setup):
    """Each prompt under the base model, a1 and a2, interleaved in one batch."""
    names = [None, "a1", "a2"]
    prompts, loras, expected = [], [], []
    for i, prompt in enumerate(setup["prompts"]):
        for j in range(3):
            name = names[(i + j) % 3]
            prompts.append(prompt)
            loras.append(None if name is None else setup["loras"][name])
            expected.append(setup["refs"][name][i])
    return prompts, loras, expected


def test_mixed_batch_matches_hf_on_merged_weights(setup):
    llm = LLM(str(setup["base"]), enforce_eager=True, enable_lora=True, max_loras=2,
              max_lora_rank=8, max_model_len=128)
    prompts, loras, expected = _mixed(setup)
    outs = _run(llm, prompts, loras, logprobs=0)
    assert [o.outputs[0].token_ids for o in outs] == expected
    # logprobs close to HF's on the merged checkpoint (a2: rsLoRA scaling)
    for out, prompt, lora in zip(outs, prompts, loras):
        model = setup["base"] if lora is None else setup["merged"][lora.lora_name]
        got = [next(iter(step.values())).logprob for step in out.outputs[0].logprobs]
        want = _hf_token_logprobs(model, prompt, list(out.outputs[0].token_ids))
        assert got == pytest.approx(want, abs=2e-4)
    # each alone gives the same tokens as in the mixed batch
    for name in ("a1", "a2"):
        alone = _run(llm, setup["prompts"], setup["loras"][name])
        assert [o.outputs[0].token_ids for o in alone] == setup["refs"][name]
    llm.shutdown()


def test_one_slot_two_adapters_and_prefix_cache_kept_apart(setup, inprocess_core):
    """max_loras=1: the scheduler runs one adapter's requests at a time (the manager raises if a
    step needs two), max_cpu_loras=1 reloads an evicted adapter from disk; a prompt cached
    under one adapter is never a hit for another or for the base model."""
    llm = LLM(str(setup["base"]), enforce_eager=True, enable_lora=True, max_loras=1,
              max_cpu_loras=1, max_lora_rank=8, max_model_len=128, block_size=4)
    prompts, loras, expected = _mixed(setup)
    outs = _run(llm, prompts, loras)
    assert [o.outputs[0].token_ids for o in outs] == expected
    llm.reset_prefix_cache()
    long = setup["prompts"][2]  # 21 tokens: 5 full blocks
    first = _run(llm, [long], setup["loras"]["a1"])[0]
    again = _run(llm, [long], setup["loras"]["a1"])[0]
    other = _run(llm, [long], setup["loras"]["a2"])[0]
    base = _run(llm, [long], None)[0]
    assert first.num_cached_tokens == 0 and again.num_cached_tokens == 20
    assert other.num_cached_tokens == 0 and base.num_cached_tokens == 0
    assert list(other.outputs[0].token_ids) == setup["refs"]["a2"][2]
    assert list(base.outputs[0].token_ids) == setup["refs"][None][2]
    llm.shutdown()


def test_mode3_graph_serves_every_adapter_mix(setup):
    """The op traces into the piecewise graph (fullgraph: no breaks); one graph serves any mix,
    the slot indices and adapter weights being runtime inputs."""
    llm = LLM(str(setup["base"]), enable_lora=True, max_loras=2, max_lora_rank=8,
              max_model_len=128, compilation_config={"mode": 3, "backend": "eager"})
    prompts, loras, expected = _mixed(setup)
    assert [o.outputs[0].token_ids for o in _run(llm, prompts, loras)] == expected
    alone = _run(llm, setup["prompts"], setup["loras"]["a2"])
    assert [o.outputs[0].token_ids for o in alone] == setup["refs"]["a2"]
    llm.shutdown()


def test_lora_request_without_enable_lora_is_refused_by_name(setup):
    llm = LLM(str(setup["base"]), enforce_eager=True, max_model_len=64, max_lora_rank=16)
    with pytest.raises(ValueError, match="--enable-lora"):
        _run(llm, setup["prompts"][:1], setup["loras"]["a1"])
    llm.shutdown()


def test_tensor_parallel_is_refused_clearly(setup):
    from kiln.engine.arg_utils import EngineArgs

    with pytest.raises(ValueError, match="--enable-lora.*--tensor-parallel-size"):
        EngineArgs(model=str(setup["base"]), enable_lora=True, tensor_parallel_size=2,
                   distributed_executor_backend="mp").create_kiln_config()
