"""LoRA under tensor parallelism (2 ranks, mp executor): each rank holds its shard of every
adapter (B of column-parallel layers by output, A of row-parallel ones by input), greedy tokens
equal HF's on the merged weights (so TP=1's, test_lora_engine.py), and an adapter that cannot
be read ends only its requests, as with one process."""
import shutil

import pytest
import torch
from lora_adapters import token_logprobs

from kiln.entrypoints.llm import LLM
from kiln.lora.layers import rank_shard
from kiln.lora.request import LoRARequest
from kiln.model.layers.linear import (
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from kiln.sampling_params import SamplingParams

MAX_TOKENS = 6

pytestmark = pytest.mark.usefixtures("inprocess_core")


def _run(llm, prompts, loras, **kw):
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, **kw)
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
                        lora_request=loras)


def test_tp2_matches_hf_on_merged_weights_and_a_lost_adapter_ends_only_its_requests(
        lora_setup, tmp_path):
    copy = shutil.copytree(lora_setup["adapters"]["a1"], tmp_path / "a1")
    gone = LoRARequest("gone", 7, str(copy))
    a1, a2 = lora_setup["loras"]["a1"], lora_setup["loras"]["a2"]
    llm = LLM(str(lora_setup["base"]), enforce_eager=True, enable_lora=True, max_loras=2,
              max_cpu_loras=2, max_lora_rank=8, max_model_len=128, dtype="float32",
              tensor_parallel_size=2, distributed_executor_backend="mp")
    try:
        prompts, loras, expected = [], [], []
        for i, prompt in enumerate(lora_setup["prompts"]):
            for name in (None, "a1", "a2"):
                prompts.append(prompt)
                loras.append(None if name is None else lora_setup["loras"][name])
                expected.append(lora_setup["refs"][name][i])
        outs = _run(llm, prompts, loras, logprobs=0)
        assert [list(o.outputs[0].token_ids) for o in outs] == expected
        for out, prompt, lora in zip(outs[:3], prompts, loras):  # one prompt's three
            model = lora_setup["models"][None if lora is None else lora.lora_name]
            got = [next(iter(step.values())).logprob for step in out.outputs[0].logprobs]
            want = token_logprobs(model, prompt, list(out.outputs[0].token_ids))
            assert got == pytest.approx(want, abs=2e-4)
        prompt = lora_setup["prompts"][0]
        assert list(_run(llm, [prompt], gone)[0].outputs[0].token_ids) == \
            lora_setup["refs"]["a1"][0]
        _run(llm, [prompt], a1)  # the LRU slot and host copy: `gone` leaves both
        _run(llm, [prompt], a2)
        shutil.rmtree(copy)
        failed, base = _run(llm, [prompt, prompt], [gone, None])
        assert failed.outputs[0].finish_reason == "abort"
        assert "not a directory" in failed.outputs[0].error
        assert list(base.outputs[0].token_ids) == lora_setup["refs"][None][0]
        again = _run(llm, [prompt], a2)[0]  # the engine (both ranks) serves on
        assert list(again.outputs[0].token_ids) == lora_setup["refs"]["a2"][0]
    finally:
        llm.shutdown()


def test_rank_shards_rebuild_the_whole_adapter():
    """Two ranks' shards of each module give the one-rank delta: q/gate/up split by output,
    K/V replicated where ranks outnumber KV heads, o/down split by input (partial sums)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 32, generator=g)

    def pair(fan_in, fan_out):
        return torch.randn(4, fan_in, generator=g), torch.randn(fan_out, 4, generator=g)

    qkv = [QKVParallelLinear(32, 8, 4, 1, bias=False, tp_rank=r, tp_size=2) for r in (0, 1)]
    gate_up = [MergedColumnParallelLinear(32, [48, 48], bias=False, tp_rank=r, tp_size=2)
               for r in (0, 1)]
    for layers, part, (a, b) in ((qkv, 0, pair(32, 32)), (qkv, 1, pair(32, 8)),
                                 (qkv, 2, pair(32, 8)), (gate_up, 1, pair(32, 48))):
        shards = [rank_shard(layer, part, a, b) for layer in layers]
        assert all(sa is a for sa, _ in shards)
        whole = x @ a.t() @ b.t()
        deltas = [x @ sa.t() @ sb.t() for sa, sb in shards]
        if layers is qkv and part > 0:  # one KV head: each rank holds all of it
            assert all(torch.equal(d, whole) for d in deltas)
        else:
            torch.testing.assert_close(torch.cat(deltas, dim=1), whole)
    row = [RowParallelLinear(32, 16, bias=False, tp_rank=r, tp_size=2) for r in (0, 1)]
    a, b = pair(32, 16)
    shards = [rank_shard(layer, 0, a, b) for layer in row]
    partial = [x[:, r * 16:(r + 1) * 16] @ sa.t() @ sb.t() for r, (sa, sb) in enumerate(shards)]
    torch.testing.assert_close(partial[0] + partial[1], x @ a.t() @ b.t())


def test_the_reason_a_rank_gave_is_the_one_raised():
    """A rank that failed only because another did carries no reason: the engine raises the
    reading rank's, whichever rank answered first."""
    from kiln.lora.load_failure import LoRALoadError, LoRALoadFailure, raise_rank_failure

    raise_rank_failure([None, "tokens"])  # no failure: nothing raised
    with pytest.raises(LoRALoadError, match="not a directory") as e:
        raise_rank_failure([LoRALoadFailure(7, "failed on another rank", False),
                            LoRALoadFailure(7, "'/x' is not a directory", True)])
    assert e.value.lora_int_id == 7
