"""A weight update that changes an fp8 KV cache's k_scale / v_scale: no block written as
x / old scale is read with the new one, neither a running request's own nor a cached prefix's
(the engine core recomputes running requests and resets the prefix cache)."""
import pytest
from safetensors.torch import load_file

from kiln.entrypoints.llm import LLM
from kiln.sampling_params import SamplingParams

from kv_cache_checkpoint import kv_only_config, with_kv_scales, with_quantization_config

PROMPT = {"prompt_token_ids": [7, 3, 9, 1, 4, 4, 8, 2, 6, 5, 3, 3, 7, 1, 2, 9, 8, 8, 4, 6, 11,
                               5, 9, 2]}
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, logprobs=0, ignore_eos=True)


def _old(layer):
    return 0.3 + 0.1 * layer, 2.5 + 0.5 * layer


def _new(layer):
    return 0.02 + 0.01 * layer, 0.05


def _checkpoint(src, dst, scales):
    return with_kv_scales(with_quantization_config(src, dst, kv_only_config()), scales)


def _llm(model_dir) -> LLM:
    return LLM(model=str(model_dir), max_model_len=64, max_num_seqs=4, kv_cache_memory=0.001,
               enforce_eager=True)


def _logprobs(completion) -> list[float]:
    return [next(iter(lp.values())).logprob for lp in completion.logprobs]


@pytest.mark.parametrize("fails_after", [False, True])
def test_new_kv_scales_recompute_running_requests_and_forget_cached_blocks(
        tiny_llama_dir, tmp_path, monkeypatch, fails_after):
    """`fails_after`: the update raises on a name no parameter has, after the scales before it
    were written: what it changed is handled as a whole update's."""
    monkeypatch.setenv("KILN_ENABLE_V1_MULTIPROCESSING", "0")
    new_dir = _checkpoint(tiny_llama_dir, tmp_path / "new", _new)
    scales = [(n, t) for n, t in load_file(str(new_dir / "model.safetensors")).items()
              if n.endswith(("k_scale", "v_scale"))]
    llm = _llm(_checkpoint(tiny_llama_dir, tmp_path / "old", _old))
    try:
        engine, final, before = llm.llm_engine, [], 0
        engine.add_request("running", PROMPT, PARAMS)
        for _ in range(3):  # the prompt's prefill and two decodes, under the old scales
            for out in engine.step():
                before = len(out.outputs[0].token_ids)
        if fails_after:
            with pytest.raises(Exception, match="model.no_such_weight"):
                llm.collective_rpc("load_weights", kwargs={
                    "weights": [*scales, ("model.no_such_weight", scales[0][1])]})
        else:
            llm.collective_rpc("load_weights", kwargs={"weights": scales})
        while engine.has_unfinished_requests():
            final += [o for o in engine.step() if o.finished]
        (running,) = [o.outputs[0] for o in final]
        (again,) = llm.generate(PROMPT, PARAMS, use_tqdm=False)  # its blocks cached again
    finally:
        llm.shutdown()
    assert 0 < before < PARAMS.max_tokens
    ref = _llm(new_dir)
    try:
        (want_again,) = ref.generate(PROMPT, PARAMS, use_tqdm=False)
        # the running request goes on from the tokens it had, under the new scales only
        (want_rest,) = ref.generate(
            {"prompt_token_ids": PROMPT["prompt_token_ids"] + running.token_ids[:before]},
            SamplingParams(max_tokens=PARAMS.max_tokens - before, temperature=0.0, logprobs=0,
                           ignore_eos=True), use_tqdm=False)
    finally:
        ref.shutdown()
    assert running.token_ids[before:] == want_rest.outputs[0].token_ids
    assert _logprobs(running)[before:] == pytest.approx(_logprobs(want_rest.outputs[0]),
                                                        abs=1e-4)
    assert again.outputs[0].token_ids == want_again.outputs[0].token_ids
    assert _logprobs(again.outputs[0]) == pytest.approx(_logprobs(want_again.outputs[0]),
                                                        abs=1e-4)
