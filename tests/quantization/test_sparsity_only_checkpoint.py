"""A compressed-tensors checkpoint that quantizes no layer (no config_groups and no
kv_cache_scheme: a sparsified model stored dense, as llm-compressor writes it, or empty groups)
is served as vLLM serves it: its weights dense in the model dtype, with a warning saying so;
sparse storage Kiln cannot read (2:4 compressed) is refused naming sparsity_config.format."""
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from kiln.entrypoints.llm import LLM
from kiln.errors import ConfigError
from kiln.sampling_params import SamplingParams

from kv_cache_checkpoint import with_quantization_config

PROMPTS = [{"prompt_token_ids": [7, 3, 9, 1, 4, 4, 8, 2, 6, 5, 3, 3, 7, 1, 2, 9, 8, 8, 4, 6, 11]},
           {"prompt_token_ids": [31, 32, 33, 34, 35, 36, 37, 38, 39]}]
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, logprobs=0, ignore_eos=True)


def sparsity(fmt: str = "dense") -> dict:
    """llm-compressor's sparsity_config of a 2:4 pruned model (SparseGPT), stored as `fmt`."""
    return {"format": fmt, "global_sparsity": 0.45, "ignore": ["lm_head"],
            "registry_requires_subclass": False, "sparsity_structure": "2:4",
            "targets": ["Linear"]}


# what compressed-tensors' ModelCompressor writes with no quantization: the method and sparsity
SPARSE_ONLY = {"quant_method": "compressed-tensors", "version": "0.9.1",
               "sparsity_config": sparsity()}
EMPTY_GROUPS = {"quant_method": "compressed-tensors", "format": "dense", "config_groups": {},
                "quantization_status": "compressed", "ignore": [], "kv_cache_scheme": None,
                "sparsity_config": {}}


def _pruned_2_4(dst):
    """`dst`'s decoder linears pruned 2:4 in place (the two smallest of each four in a row
    zeroed), as SparseGPT leaves a model that llm-compressor saves dense."""
    tensors = load_file(str(dst / "model.safetensors"))
    for name, t in tensors.items():
        if ".layers." in name and name.endswith("proj.weight"):
            groups = t.reshape(-1, 4)
            keep = groups.abs().topk(2, dim=1).indices
            mask = torch.zeros_like(groups, dtype=torch.bool).scatter_(1, keep, True)
            tensors[name] = (groups * mask).reshape(t.shape)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def _run(model_dir):
    llm = LLM(model=str(model_dir), max_model_len=64, max_num_seqs=8, kv_cache_memory=0.001,
              enforce_eager=True)
    try:
        outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        kind = llm.llm_engine.model_config.quant_kind
    finally:
        llm.shutdown()
    return ([o.outputs[0].token_ids for o in outs],
            [[next(iter(lp.values())).logprob for lp in o.outputs[0].logprobs] for o in outs],
            kind)


@pytest.mark.parametrize("config,what", [
    (SPARSE_ONLY, "sparsity_config with structure '2:4' stored 'dense'"),
    (EMPTY_GROUPS, "nothing"),
], ids=["sparsity-only", "empty-groups"])
def test_a_config_quantizing_nothing_serves_the_dense_weights(tiny_llama_dir, tmp_path,
                                                              monkeypatch, kiln_logs, config,
                                                              what):
    monkeypatch.setenv("KILN_ENABLE_V1_MULTIPROCESSING", "0")
    pruned = _pruned_2_4(with_quantization_config(tiny_llama_dir, tmp_path / "q", config))
    tokens, logprobs, kind = _run(pruned)
    assert kind is None
    assert f"quantizes no layer (no config_groups, no kv_cache_scheme; {what}): the weights " \
           "are served as stored, dense" in kiln_logs.text
    # the same pruned weights without a quantization_config: the same tokens and logprobs
    plain = _pruned_2_4(shutil.copytree(tiny_llama_dir, tmp_path / "plain"))
    want_tokens, want_logprobs, _ = _run(plain)
    assert (tokens, logprobs) == (want_tokens, want_logprobs)


def test_2_4_compressed_storage_is_refused_naming_its_format(tiny_llama_dir, tmp_path,
                                                             monkeypatch):
    monkeypatch.setenv("KILN_ENABLE_V1_MULTIPROCESSING", "0")
    model = with_quantization_config(tiny_llama_dir, tmp_path / "q", {
        **SPARSE_ONLY, "sparsity_config": sparsity("sparse-24-bitmask")})
    with pytest.raises(ConfigError, match=r"quantization_config\.sparsity_config\.format="
                                          r"'sparse-24-bitmask' is not supported.*only 'dense'"):
        _run(model)
