"""Weight loading: sharded safetensors, missing files and parameters, dummy weights, stories260K."""
import json
import shutil

import pytest
import torch

from kiln.model.loader import build_model, get_model
from model._attn_helper import greedy_generate, kiln_config_for

from checkpoints import STORIES_DIR


def test_sharded_checkpoint_loads_like_single(tiny_llama_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    state = load_file(str(tiny_llama_dir / "model.safetensors"))
    names = sorted(state)
    shards = {"model-00001-of-00002.safetensors": names[::2],
              "model-00002-of-00002.safetensors": names[1::2]}
    for fname, keys in shards.items():
        save_file({k: state[k] for k in keys}, str(tmp_path / fname))
    weight_map = {k: f for f, keys in shards.items() for k in keys}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    shutil.copy(tiny_llama_dir / "config.json", tmp_path / "config.json")
    single = dict(get_model(kiln_config_for(tiny_llama_dir)).named_parameters())
    sharded = dict(get_model(kiln_config_for(tmp_path)).named_parameters())
    assert all(torch.equal(single[n], sharded[n]) for n in single)


def test_missing_weight_file_names_path(tiny_llama_dir, tmp_path):
    shutil.copy(tiny_llama_dir / "config.json", tmp_path / "config.json")
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "model.safetensors")):
        get_model(kiln_config_for(tmp_path))


def test_missing_parameter_is_named(tiny_qwen2_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    state = load_file(str(tiny_qwen2_dir / "model.safetensors"))
    del state["model.layers.1.self_attn.k_proj.bias"]
    del state["model.norm.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    shutil.copy(tiny_qwen2_dir / "config.json", tmp_path / "config.json")
    with pytest.raises(ValueError, match=r"missing 2 parameter\(s\): .*model\.layers\.1\.self_attn"
                                         r"\.qkv_proj\.bias \(shard k\).*model\.norm\.weight"):
        get_model(kiln_config_for(tmp_path))


def test_dummy_weights_are_seeded_and_sane(tiny_llama_dir):
    def params(seed):
        cfg = kiln_config_for(tiny_llama_dir, load_format="dummy", seed=seed)
        return dict(get_model(cfg).named_parameters())

    a, b, c = params(0), params(0), params(1)
    assert all(torch.equal(a[n], b[n]) for n in a)
    assert not torch.equal(a["model.embed_tokens.weight"], c["model.embed_tokens.weight"])
    assert torch.all(a["model.norm.weight"] == 1)
    assert 0.01 < a["lm_head.weight"].std() < 0.03


def test_dummy_int8_weights_are_random_int8_with_positive_scales(tiny_llama_dir, tmp_path):
    """A compressed-tensors checkpoint with --load-format dummy got all-zero int8 weights (a
    normal draw of std 0.02, truncated) and scales of random sign: a constant model."""
    from kiln.model.layers.quantization import get_quant_config
    from kiln.model.loader.dummy_loader import init_dummy_weights

    from w8a8_checkpoint import write_w8a8_checkpoint

    d = write_w8a8_checkpoint(tiny_llama_dir, tmp_path / "q")
    config = kiln_config_for(d)
    model = build_model(config)  # as get_model does, short of packing the weights away
    get_quant_config(config.model_config).prepare(model)
    init_dummy_weights(model, seed=0)
    params = dict(model.named_parameters())
    w = params["model.layers.0.mlp.down_proj.weight"]
    assert w.dtype == torch.int8 and w.float().std() > 50
    scale = params["model.layers.0.mlp.down_proj.weight_scale"]
    assert torch.all(scale > 0)
    assert 0.01 < (w.float() * scale.reshape(-1, 1)).std() < 0.03


def test_bfloat16_build_keeps_rope_cache_float32(tiny_qwen3_dir):
    model = build_model(kiln_config_for(tiny_qwen3_dir, dtype="bfloat16"))
    assert model.lm_head.weight.dtype == torch.bfloat16
    rope = model.model.layers[0].self_attn.rotary_emb
    assert rope.cos_sin_cache.dtype == torch.float32
    # one rotary (and cos/sin cache) for every layer, not a copy per layer
    assert all(layer.self_attn.rotary_emb is rope for layer in model.model.layers)


def test_stories260k_greedy_from_bos_matches_hf():
    from transformers import AutoModelForCausalLM

    cfg = kiln_config_for(STORIES_DIR)
    ours = greedy_generate(get_model(cfg), cfg, [1], max_new_tokens=40, num_blocks=8)
    hf = AutoModelForCausalLM.from_pretrained(STORIES_DIR, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf.generate(torch.tensor([[1]]), max_new_tokens=40, min_new_tokens=40,
                          do_sample=False, pad_token_id=0)[0, 1:].tolist()
    assert ours == ref
