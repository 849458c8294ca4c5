"""vLLM's --hf-overrides / LLM(hf_overrides=...): changes to the HF config applied before the
model is built (sub-configs merged, other keys replaced, as vLLM's _apply_dict_overrides), in
the compile cache key; the engine then runs as HF transformers does on the edited config.json.
It was refused ("edit a copy of config.json")."""
import json
import shutil

import pytest

from kiln.config.hf_config_snapshot import HFConfigSnapshot
from kiln.config.hf_overrides import apply_hf_overrides
from kiln.engine.arg_utils import EngineArgs
from kiln.entrypoints.cli.main import build_parser

from checkpoints import hf_greedy, random_prompts

# a plain value, a legacy dict-valued one (transformers 5 keeps rope_parameters) and the length
OVERRIDES = {"rms_norm_eps": 0.5, "rope_scaling": {"rope_type": "linear", "factor": 8.0},
             "max_position_embeddings": 256}


def test_the_engine_runs_the_overridden_config_as_hf_runs_the_edited_file(tiny_llama_dir,
                                                                           tmp_path):
    from kiln import LLM, SamplingParams

    edited = tmp_path / "edited"
    shutil.copytree(tiny_llama_dir, edited)
    config = json.loads((edited / "config.json").read_text())
    config.update(OVERRIDES)
    (edited / "config.json").write_text(json.dumps(config))
    prompts = random_prompts(2, [40, 60], seed=5)
    want = hf_greedy(edited, prompts, 8)
    assert want != hf_greedy(tiny_llama_dir, prompts, 8)  # the override changes the answer
    llm = LLM(model=str(tiny_llama_dir), enforce_eager=True, hf_overrides=OVERRIDES,
              kv_cache_memory=0.02)
    try:
        mc = llm.llm_engine.model_config
        assert mc.hf_config.rope_parameters == {"rope_type": "linear", "factor": 8.0,
                                                "rope_theta": 10000.0}
        assert mc.max_model_len == 256 * 8  # the overridden length, stretched by the factor
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
                            use_tqdm=False)
    finally:
        llm.shutdown()
    assert [list(o.outputs[0].token_ids) for o in outs] == want


def test_overrides_are_in_the_compile_cache_key(tiny_llama_dir):
    plain = EngineArgs(model=str(tiny_llama_dir)).create_kiln_config()
    over = EngineArgs(model=str(tiny_llama_dir), hf_overrides=OVERRIDES).create_kiln_config()
    assert plain.compute_hash() != over.compute_hash()
    assert plain.model_config.hf_config.rope_parameters == {"rope_type": "default",
                                                            "rope_theta": 10000.0}


def test_the_flag_takes_json_and_crosses_to_a_child_command(tiny_llama_dir):
    args = build_parser().parse_args(["generate", "--hf-overrides", json.dumps(OVERRIDES)])
    engine_args = EngineArgs.from_cli_args(args)
    assert engine_args.hf_overrides == OVERRIDES
    again = EngineArgs.from_cli_args(build_parser().parse_args(
        ["generate", *engine_args.to_cli_args()]))
    assert again == engine_args
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--hf-overrides", "[1]"])
    with pytest.raises(ValueError, match="hf_overrides as a function"):
        EngineArgs(model=str(tiny_llama_dir), hf_overrides=lambda c: c).create_kiln_config()


def test_sub_configs_merge_and_other_dicts_are_replaced():
    base = HFConfigSnapshot({
        "model_type": "m", "text_config": {"model_type": "t", "hidden_size": 8, "a": {"b": 1,
                                                                                       "c": 2}},
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "extra": {"x": 1, "y": 2}})
    out = apply_hf_overrides(base, {"text_config": {"hidden_size": 16, "a": {"b": 3}},
                                    "extra": {"x": 5},
                                    "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert out.text_config == {"model_type": "t", "hidden_size": 16, "a": {"b": 3, "c": 2}}
    assert out.extra == {"x": 5}
    # the legacy key also reaches rope_parameters (what transformers 5 configs keep)
    assert out.rope_parameters == {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0}
    assert base.text_config["hidden_size"] == 8  # the original is untouched


@pytest.mark.parametrize("overrides", [{"num_hidden_layers": 1}, {"vocab_size": 600}])
def test_a_shape_override_the_weights_do_not_fit_names_the_flag(tiny_llama_dir, inprocess_core,
                                                                 overrides):
    """The checkpoint fits its config.json; an override of a shape key made it not fit, and the
    refusal said "fix the config or use the checkpoint it came with", not --hf-overrides."""
    from kiln import LLM

    with pytest.raises(ValueError, match=r"--hf-overrides changed \['" + next(iter(overrides))):
        LLM(model=str(tiny_llama_dir), compilation_config=0, hf_overrides=overrides,
            kv_cache_memory=0.02, max_model_len=64)


def test_a_torch_dtype_override_reaches_the_dtype_kiln_reads(tiny_llama_dir):
    """transformers 5 keeps `dtype` (and its config's torch_dtype setter writes it, which is
    how vLLM's override takes effect); the snapshot kept both keys and Kiln read the stale
    `dtype`: a GPU engine with dtype auto ignored the override."""
    import torch

    from kiln.config.model_config import ModelConfig

    mc = ModelConfig(model=str(tiny_llama_dir), hf_overrides={"torch_dtype": "float16"})
    assert mc.hf_config.dtype == "float16"
    assert mc.resolve_dtype(torch.bfloat16) == torch.float16  # a GPU platform's default
    both = apply_hf_overrides(mc.hf_config, {"torch_dtype": "float16", "dtype": "bfloat16"})
    assert both.dtype == "bfloat16"  # `dtype` named too: it wins


@pytest.mark.parametrize("overrides, message", [
    ({"num_attention_heads": 0}, "num_attention_heads must be an integer >= 1, got 0"),
    ({"hidden_size": "abc"}, "hidden_size must be an integer >= 1, got 'abc'"),
    ({"head_dim": 7.5}, "head_dim must be an integer >= 1 or null, got 7.5"),
    ({"attention_multiplier": None}, "attention_multiplier must be a finite number, got None"),
    ({"residual_multiplier": [1]}, "residual_multiplier must be a finite number, got"),
    ({"logits_scaling": 0}, "logits_scaling must be a finite number other than 0, got 0"),
    ({"rms_norm_eps": "1e-5"}, "rms_norm_eps must be a finite number"),
    ({"tie_word_embeddings": "yes"}, "tie_word_embeddings must be true or false"),
])
def test_values_the_models_cannot_read_are_refused_naming_the_key(overrides, message):
    """They failed in the engine core as a TypeError / ZeroDivisionError traceback, or (Granite's
    logits_scaling 0) served logits divided by zero."""
    base = HFConfigSnapshot({"model_type": "granite", "hidden_size": 64,
                             "num_attention_heads": 4})
    with pytest.raises(ValueError, match=r"hf_overrides \(--hf-overrides\) " + message):
        apply_hf_overrides(base, overrides)
    assert apply_hf_overrides(base, {"head_dim": None, "num_key_value_heads": 2,
                                     "attention_multiplier": 1}).num_key_value_heads == 2
