"""Config variants real checkpoints use, against HF transformers (float32 logits through prefill
and paged decode): explicit head_dim, biases, tying, MQA, rope scaling, sliding windows, MoE
layouts.

Every parameter is random here, biases and norm weights included, so a bias or norm loaded into
the wrong place (or left out) shows in the logits.
"""
import pytest
import torch

from kiln.config.model_config import sliding_window_of
from kiln.model.loader import get_model
from model._attn_helper import (
    BlockPool,
    PagedRequest,
    allocate_kv_caches,
    build_step,
    kiln_config_for,
    run_step,
)

from checkpoints import save_tiny_tokenizer

TOL = 1e-4
LLAMA3 = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
              original_max_position_embeddings=16)


def make_checkpoint(path, config_cls: str, **overrides):
    """A tiny random checkpoint of transformers' `config_cls`, every parameter random."""
    import transformers

    kw = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, vocab_size=512, max_position_embeddings=512,
              tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    kw.update(overrides)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        getattr(transformers, config_cls)(**kw), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() > 1 and "norm" not in name:  # (Cohere's q / k norms are 2-D)
                p.normal_(0, 0.08)
            elif "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:  # biases: HF initialises them to zero, which would hide a lost bias
                p.normal_(0, 0.05)
    model.save_pretrained(path)
    save_tiny_tokenizer(path, kw["vocab_size"])
    return path


def max_logit_diff(path, seq_len: int = 30, **config_kw) -> float:
    """Kiln (prefill of all but 5 tokens, then 5 decode steps) vs HF's logits, max abs diff."""
    from transformers import AutoModelForCausalLM

    cfg = kiln_config_for(path, **config_kw)
    model = get_model(cfg)
    allocate_kv_caches(model, cfg, 64, 4)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    seq = torch.randint(3, 512, (seq_len,), generator=torch.Generator().manual_seed(1)).tolist()
    with torch.no_grad():
        ref = hf(torch.tensor([seq])).logits[0]  # [S, V]
    pool, req = BlockPool(64, 4), PagedRequest(seq)
    got = []
    for q in (seq_len - 5, 1, 1, 1, 1, 1):
        ids, pos, md = build_step(pool, [req], [q])
        got.append(run_step(model, cfg, ids, pos, md))
    return (torch.cat(got) - ref).abs().max().item()


CASES = {
    "llama_head_dim_wider": ("LlamaConfig", dict(head_dim=32)),
    "llama_head_dim_narrower": ("LlamaConfig", dict(head_dim=8)),
    "llama_attention_and_mlp_bias": ("LlamaConfig", dict(attention_bias=True, mlp_bias=True)),
    "llama_tied": ("LlamaConfig", dict(tie_word_embeddings=True)),
    "llama_one_kv_head": ("LlamaConfig", dict(num_key_value_heads=1)),
    "llama_rope_llama3": ("LlamaConfig", dict(rope_scaling=LLAMA3)),
    "llama_rope_linear_old_key": ("LlamaConfig", dict(rope_scaling={"type": "linear",
                                                                    "factor": 4.0})),
    "llama_theta_and_eps": ("LlamaConfig", dict(rope_theta=500000.0, rms_norm_eps=1e-2)),
    "mistral_no_window": ("MistralConfig", dict(sliding_window=None)),
    "qwen2_untied": ("Qwen2Config", dict()),
    "granite_biases_untied": ("GraniteConfig", dict(attention_bias=True, mlp_bias=True,
                                                   embedding_multiplier=2.0,
                                                   residual_multiplier=0.5,
                                                   attention_multiplier=0.2, logits_scaling=2.0)),
    "gemma_untied_bias_mqa": ("GemmaConfig", dict(head_dim=8, attention_bias=True,
                                                  num_key_value_heads=1, pad_token_id=0)),
    "olmo2_bias_tied_mqa": ("Olmo2Config", dict(attention_bias=True, tie_word_embeddings=True,
                                                num_key_value_heads=1, pad_token_id=0)),
    "phi3_tied_one_kv_head": ("Phi3Config", dict(tie_word_embeddings=True, sliding_window=None,
                                                 num_key_value_heads=1, pad_token_id=0)),
    "qwen2_tied": ("Qwen2Config", dict(tie_word_embeddings=True)),
    "qwen3_head_dim_wider": ("Qwen3Config", dict(head_dim=32)),
    "qwen3_bias_tied": ("Qwen3Config", dict(head_dim=16, attention_bias=True,
                                            tie_word_embeddings=True)),
    # flags HF's class for the model never reads: no such tensors, and HF serves it (refused
    # as missing biases; helper-64)
    "qwen2_mlp_bias_unread": ("Qwen2Config", dict(mlp_bias=True)),
    "qwen3_mlp_bias_unread": ("Qwen3Config", dict(head_dim=16, mlp_bias=True)),
    "mistral_biases_unread": ("MistralConfig", dict(sliding_window=None, attention_bias=True,
                                                    mlp_bias=True)),
    # mixtures of experts: random q/k/v biases and norms, every second layer sparse, top-1
    # routing renormalized (Qwen2-MoE's qkv_bias off: no bias tensors)
    "qwen2_moe_sparse_step_bias": ("Qwen2MoeConfig", dict(
        num_experts=3, num_experts_per_tok=1, moe_intermediate_size=16, norm_topk_prob=True,
        shared_expert_intermediate_size=24, decoder_sparse_step=2)),
    "qwen2_moe_no_qkv_bias": ("Qwen2MoeConfig", dict(
        num_experts=4, num_experts_per_tok=3, moe_intermediate_size=16, qkv_bias=False,
        shared_expert_intermediate_size=24)),
    "qwen3_moe_bias_tied": ("Qwen3MoeConfig", dict(
        num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, head_dim=16,
        attention_bias=True, tie_word_embeddings=True)),
    # LayerNorm families, every bias and norm random: StarCoder2 without biases and a window
    # of 6; with them, exact GELU, MQA, tied
    "starcoder2_no_bias_window": ("Starcoder2Config", dict(use_bias=False, sliding_window=6)),
    "starcoder2_bias_gelu_mqa_tied": ("Starcoder2Config", dict(
        hidden_act="gelu", num_key_value_heads=1, tie_word_embeddings=True)),
    # GPT-NeoX sequential residual over a whole-head rope; no attention biases, half-head
    # rope, gelu_new, tied (HF's GPT-NeoX has no KV grouping: 4 KV heads of 4)
    "gpt_neox_sequential_full_rotary": ("GPTNeoXConfig", dict(
        use_parallel_residual=False, rotary_pct=1.0, num_key_value_heads=4)),
    "gpt_neox_no_bias_half_rotary_tied": ("GPTNeoXConfig", dict(
        attention_bias=False, rotary_pct=0.5, hidden_act="gelu_new", num_key_value_heads=4,
        tie_word_embeddings=True)),
    # Phi with per-head q/k LayerNorms, rope over the whole head, MQA, tied (the head's bias
    # still its own); Cohere with per-head q/k norms (a weight per head), attention biases,
    # MQA, untied, another logit scale
    "phi_qk_layernorm_full_rotary_mqa_tied": ("PhiConfig", dict(
        qk_layernorm=True, partial_rotary_factor=1.0, num_key_value_heads=1,
        tie_word_embeddings=True)),
    "cohere_qk_norm_bias_mqa_untied": ("CohereConfig", dict(
        use_qk_norm=True, attention_bias=True, num_key_value_heads=1, logit_scale=0.25,
        pad_token_id=0)),
    # OLMo-3: biases, tied, MQA, the global layer first (window 6); SmolLM3: layer 0 NoPE,
    # biases; EXAONE-4 without a window: every layer global and roped; GLM-4 roping the whole
    # head, no biases, tied, MQA; Seed-OSS with MLP biases, none on o_proj; ERNIE-4.5 bias-free,
    # tied
    "olmo3_bias_tied_mqa_global_first": ("Olmo3Config", dict(
        attention_bias=True, tie_word_embeddings=True, num_key_value_heads=1, sliding_window=6,
        layer_types=["full_attention", "sliding_attention"], pad_token_id=0)),
    # yarn past the original 16 positions (OLMo-3's long-context configs: on the global layers
    # only; Qwen3's on every layer), HF's attention factor and an explicit one
    "olmo3_yarn_global_layers": ("Olmo3Config", dict(
        sliding_window=6, layer_types=["sliding_attention", "full_attention"], pad_token_id=0,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 500.0},
                         "full_attention": {"rope_type": "yarn", "factor": 4.0,
                                            "original_max_position_embeddings": 16,
                                            "rope_theta": 10000.0}})),
    "qwen3_yarn_attention_factor": ("Qwen3Config", dict(
        head_dim=16, rope_scaling={"rope_type": "yarn", "factor": 2.0, "beta_fast": 8.0,
                                   "original_max_position_embeddings": 16,
                                   "attention_factor": 1.3})),
    "smollm3_nope_first_biases": ("SmolLM3Config", dict(
        no_rope_layers=[0, 1], attention_bias=True, mlp_bias=True, pad_token_id=0)),
    "exaone4_no_window_all_roped": ("Exaone4Config", dict(
        sliding_window=None, layer_types=["full_attention"] * 2, pad_token_id=0)),
    "glm4_full_rotary_tied_mqa_no_bias": ("Glm4Config", dict(
        head_dim=16, partial_rotary_factor=1.0, attention_bias=False, tie_word_embeddings=True,
        num_key_value_heads=1, pad_token_id=0)),
    "seed_oss_mlp_bias_no_out_bias": ("SeedOssConfig", dict(
        head_dim=8, attention_bias=True, attention_out_bias=False, mlp_bias=True,
        pad_token_id=0)),
    "ernie4_5_no_bias_tied": ("Ernie4_5Config", dict(head_dim=16, use_bias=False,
                                                     tie_word_embeddings=True, pad_token_id=0)),
    # a window HF's Llama never reads (Kiln windowed it: logits 3.2 off HF's)
    "llama_stray_window_unread": ("LlamaConfig", dict(sliding_window=6)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_config_variant_matches_hf(case, tmp_path):
    config_cls, overrides = CASES[case]
    path = make_checkpoint(tmp_path / case, config_cls, **overrides)
    assert max_logit_diff(path) < TOL


@pytest.mark.parametrize("rope_scaling, what", [
    ({"rope_type": "dynamic", "factor": 2.0}, "'dynamic' is not supported"),
])
def test_unsupported_rope_scaling_is_refused(rope_scaling, what, tmp_path):
    path = make_checkpoint(tmp_path / "m", "LlamaConfig", rope_scaling=rope_scaling)
    with pytest.raises(ValueError, match=what):
        get_model(kiln_config_for(path))


@pytest.mark.parametrize("overrides, what", [
    (dict(partial_rotary_factor=0.5), "partial_rotary_factor 0.5 is not supported"),
])
def test_phi3_settings_kiln_cannot_run_are_refused_naming_the_field(overrides, what, tmp_path):
    path = make_checkpoint(tmp_path / "m", "Phi3Config", sliding_window=None, pad_token_id=0,
                           **overrides)
    with pytest.raises(ValueError, match=what):
        get_model(kiln_config_for(path))


def test_rope_parameters_nested_by_layer_type_are_refused():
    """Read as one flat dict they gave theta 10000 and no scaling, silently."""
    from kiln.config.hf_config_snapshot import HFConfigSnapshot
    from kiln.config.rope import get_rope_config

    rope = {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}
    config = HFConfigSnapshot({"rope_parameters": {"full_attention": rope,
                                                   "sliding_attention": rope}})
    with pytest.raises(ValueError, match="rope_parameters nested by layer type "
                       r"\(full_attention, sliding_attention\)"):
        get_rope_config(config)


def test_sliding_window_decisions():
    from transformers import (
        GemmaConfig,
        GraniteConfig,
        LlamaConfig,
        MistralConfig,
        Olmo2Config,
        Qwen2Config,
        Qwen2MoeConfig,
        Qwen3Config,
        Qwen3MoeConfig,
    )

    from kiln.config.hf_config_snapshot import HFConfigSnapshot
    from kiln.config.sliding_window import layer_sliding_windows

    assert sliding_window_of(MistralConfig(sliding_window=4096), "MistralForCausalLM") == 4096
    assert sliding_window_of(MistralConfig(sliding_window=None), "MistralForCausalLM") is None
    assert sliding_window_of(LlamaConfig(), "LlamaForCausalLM") is None
    # HF's Llama, Granite, Gemma and OLMo-2 never read a stray window
    for config_cls in (LlamaConfig, GraniteConfig, GemmaConfig, Olmo2Config):
        config = config_cls(sliding_window=16)
        arch = config_cls.__name__.replace("Config", "ForCausalLM")
        assert sliding_window_of(config, arch) is None, arch
        assert layer_sliding_windows(config, arch) == [None] * config.num_hidden_layers
    assert sliding_window_of(LlamaConfig(sliding_window=16),
                             "LlamaForSequenceClassification") is None
    # Released Qwen2/3 configs carry a window with use_sliding_window false: full attention.
    qwen2, qwen3 = "Qwen2ForCausalLM", "Qwen3ForCausalLM"
    assert sliding_window_of(Qwen2Config(sliding_window=32768), qwen2) is None
    assert sliding_window_of(Qwen3Config(use_sliding_window=True, sliding_window=64,
                                         num_hidden_layers=4, max_window_layers=2), qwen3) == 64
    assert sliding_window_of(Qwen2Config(use_sliding_window=True, sliding_window=64,
                                         num_hidden_layers=4, max_window_layers=4), qwen2) is None
    assert layer_sliding_windows(Qwen2Config(use_sliding_window=True, sliding_window=64,
                                             num_hidden_layers=3, max_window_layers=1),
                                 "Qwen2ForSequenceClassification") == [None, 64, 64]
    # Qwen2-MoE: even layers below max_window_layers; Qwen3-MoE: every layer
    moe = Qwen2MoeConfig(use_sliding_window=True, sliding_window=8, num_hidden_layers=4,
                         max_window_layers=3)
    assert layer_sliding_windows(moe, "Qwen2MoeForCausalLM") == [8, None, 8, None]
    assert sliding_window_of(Qwen2MoeConfig(sliding_window=8), "Qwen2MoeForCausalLM") is None
    moe3 = Qwen3MoeConfig(use_sliding_window=True, sliding_window=8, num_hidden_layers=2)
    assert layer_sliding_windows(moe3, "Qwen3MoeForCausalLM") == [8, 8]
    assert sliding_window_of(Qwen3MoeConfig(sliding_window=8), "Qwen3MoeForCausalLM") is None
    # Mixtral / Phi-3's classes window every layer whatever layer_types says; a Mistral
    # config's layer_types make AutoConfig read it as Ministral's, which honours them
    both = ["full_attention", "sliding_attention"]
    for arch in ("MixtralForCausalLM", "Phi3ForCausalLM"):
        config = HFConfigSnapshot({"sliding_window": 4, "num_hidden_layers": 2,
                                   "layer_types": both})
        assert layer_sliding_windows(config, arch) == [4, 4], arch
    assert layer_sliding_windows(config, "MistralForCausalLM") == [None, 4]


@pytest.mark.parametrize("config_cls, overrides", [
    ("MistralConfig", dict(sliding_window=16)),
    ("Qwen2Config", dict(use_sliding_window=True, sliding_window=16, max_window_layers=1)),
])
def test_disable_sliding_window_caps_max_model_len_and_is_exact_within(config_cls, overrides,
                                                                       tmp_path):
    """Under --disable-sliding-window (vLLM's flag) every layer attends fully: the window caps
    max_model_len, a larger one asked for is refused, and within the window outputs match HF
    exactly. Without it the window is the attention's: past it too."""
    path = make_checkpoint(tmp_path / "m", config_cls, **overrides)
    disabled = dict(disable_sliding_window=True)
    assert kiln_config_for(path, **disabled).model_config.max_model_len == 16
    with pytest.raises(ValueError, match=r"max_model_len=17 exceeds the model's "
                       r"sliding_window=16.*--max-model-len to 16"):
        kiln_config_for(path, max_model_len=17, **disabled)
    # a prompt too long is told what lengthens it (helper-64, helper-80)
    from kiln.engine.input_processor import InputProcessor, validate_prompt_token_ids

    fix = InputProcessor(kiln_config_for(path, **disabled).model_config, None).longer_context_fix()
    assert fix.startswith("drop --disable-sliding-window"), fix
    with pytest.raises(ValueError) as e:
        validate_prompt_token_ids(list(range(20)), 512, 16, fix)
    assert str(e.value).count("shorten the prompt") == 1, e.value
    assert max_logit_diff(path, seq_len=16, **disabled) < TOL
    assert kiln_config_for(path).model_config.max_model_len == 512
    assert max_logit_diff(path, seq_len=40) < TOL  # windowed, past the window


def test_layer_types_kiln_cannot_serve_are_refused():
    from kiln.config.hf_config_snapshot import HFConfigSnapshot
    from kiln.config.sliding_window import layer_sliding_windows

    config = HFConfigSnapshot({"sliding_window": 4, "num_hidden_layers": 2,
                               "layer_types": ["sliding_attention", "chunked_attention"]})
    with pytest.raises(ValueError, match="layer_types 'chunked_attention' are not supported"):
        layer_sliding_windows(config, "Qwen2ForCausalLM")
    config = HFConfigSnapshot({"sliding_window": 4, "num_hidden_layers": 3,
                               "layer_types": ["sliding_attention", "full_attention"]})
    with pytest.raises(ValueError, match="layer_types names 2 layers, num_hidden_layers is 3"):
        layer_sliding_windows(config, "Gemma2ForCausalLM")


def test_a_tied_checkpoint_storing_another_head_is_served_tied_with_a_warning(tmp_path,
                                                                              kiln_logs):
    """Kiln ties, as vLLM does; transformers 5 serves the stored head (logits up to 3.8 apart
    on a random model, with no word from Kiln; helper-64). An equal stored head says nothing."""
    from safetensors.torch import load_file, save_file

    path = make_checkpoint(tmp_path / "m", "LlamaConfig", tie_word_embeddings=True)
    tensors = load_file(path / "model.safetensors")
    embedding = tensors["model.embed_tokens.weight"]
    for head, warned in ((embedding.clone(), False), (embedding + 0.5, True)):
        save_file({**tensors, "lm_head.weight": head}, path / "model.safetensors",
                  metadata={"format": "pt"})
        kiln_logs.clear()
        model = get_model(kiln_config_for(path))
        torch.testing.assert_close(model.lm_head.weight, model.model.embed_tokens.weight)
        assert ("lm_head.weight differs from model.embed_tokens.weight" in kiln_logs.text) \
            == warned


@pytest.mark.parametrize("rope_scaling", [{"type": "linear", "factor": 4.0},
                                          {"rope_type": "linear", "factor": 4.0}])
def test_linear_rope_scaling_serves_factor_times_the_trained_positions(rope_scaling, tmp_path):
    """Positions are divided by the factor, so the model serves max_position_embeddings x
    factor (vicuna-7b-v1.5-16k: 4096 x 4), as vLLM derives; Kiln stopped at 4096 and refused
    --max-model-len 16384. Past the trained 16 positions outputs match HF's."""
    path = make_checkpoint(tmp_path / "m", "LlamaConfig", max_position_embeddings=16,
                           rope_scaling=rope_scaling)
    assert kiln_config_for(path).model_config.max_model_len == 64
    with pytest.raises(ValueError, match=r"max_model_len=65 exceeds the model's "
                       r"max_position_embeddings=16 x linear rope_scaling factor 4 = 64"):
        kiln_config_for(path, max_model_len=65)
    assert max_logit_diff(path, seq_len=60) < TOL


def test_yarn_serves_its_original_length_times_the_factor(tmp_path):
    """vLLM's rule (Qwen3 with yarn x4 over 32768: 131072); within it outputs match HF's."""
    path = make_checkpoint(tmp_path / "m", "LlamaConfig", rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 16})
    assert kiln_config_for(path).model_config.max_model_len == 64
    with pytest.raises(ValueError, match=r"max_model_len=65 exceeds the model's "
                       r"original_max_position_embeddings=16 x yarn rope_scaling factor 4 = 64"):
        kiln_config_for(path, max_model_len=65)
    assert max_logit_diff(path, seq_len=60) < TOL


@pytest.mark.parametrize("fields, what", [
    ({"rope_scaling": {"type": "linear", "factor": "abc"}}, "rope_scaling factor .* got 'abc'"),
    ({"rope_scaling": {"type": "linear", "factor": -2}}, "rope_scaling factor .* got -2"),
    ({"rope_scaling": {"type": "linear", "factor": 0}}, "rope_scaling factor .* got 0"),
    ({"rope_scaling": dict(LLAMA3, low_freq_factor="x")}, "rope_scaling low_freq_factor"),
    ({"rope_parameters": {"rope_type": "linear", "factor": None, "rope_theta": 1e4}},
     "rope_scaling factor .* got None"),
    ({"max_position_embeddings": -5}, "max_position_embeddings must be an integer >= 1, got -5"),
    ({"max_position_embeddings": 0}, "max_position_embeddings must be an integer >= 1, got 0"),
    # NaN frequencies: every logit NaN, served with a warning blaming float16 or the weights
    ({"rope_theta": 0.0}, "rope_theta must be a finite number > 0, got 0.0"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": -1.0}}, "rope_theta .* got -1.0"),
])
def test_rope_numbers_transformers_only_warns_about_are_refused_naming_the_field(fields, what):
    """transformers loads such a config with a warning: a string factor failed as 'could not
    convert string to float', a negative one (or max_position_embeddings) as a traceback
    building a rotary cache of negative length, and 0 served no KV block."""
    from kiln.config.hf_config_snapshot import HFConfigSnapshot
    from kiln.config.rope import max_positions_of
    from kiln.errors import ConfigError

    with pytest.raises(ConfigError, match=what):
        max_positions_of(HFConfigSnapshot({"max_position_embeddings": 16, **fields}))


def test_max_position_embeddings_written_as_a_whole_float_is_read():
    from kiln.config.hf_config_snapshot import HFConfigSnapshot
    from kiln.config.rope import max_positions_of

    assert max_positions_of(HFConfigSnapshot({"max_position_embeddings": 4096.0})) == 4096


@pytest.mark.parametrize("extra, key, length", [
    ({"max_seq_len": 24}, "max_seq_len", 24),
    ({"seq_length": 20, "max_sequence_length": 40}, "seq_length", 20),
    ({"n_positions": 1024}, "max_position_embeddings", 32),  # larger: the smallest wins
    ({"model_max_length": 48}, "model_max_length", 48),  # vLLM's Command-R rule: it wins
])
def test_max_model_len_is_the_smallest_length_key_as_vllm_derives_it(extra, key, length,
                                                                      tmp_path):
    """vLLM takes the smallest of max_position_embeddings, n_positions, max_seq_len,
    seq_length, ... (model_max_length outright); Kiln read max_position_embeddings only and
    served a config.json's shorter max_seq_len past it."""
    path = make_checkpoint(tmp_path / "m", "LlamaConfig", max_position_embeddings=32, **extra)
    assert kiln_config_for(path).model_config.max_model_len == length
    with pytest.raises(ValueError, match=rf"max_model_len={length + 1} exceeds the model's "
                       rf"{key}={length}"):
        kiln_config_for(path, max_model_len=length + 1)


def test_a_length_key_that_is_not_a_positive_integer_is_refused_naming_it():
    from kiln.config.hf_config_snapshot import HFConfigSnapshot
    from kiln.config.rope import max_positions_of
    from kiln.errors import ConfigError

    with pytest.raises(ConfigError, match="seq_length must be an integer >= 1, got 'x'"):
        max_positions_of(HFConfigSnapshot({"max_position_embeddings": 16, "seq_length": "x"}))


@pytest.mark.parametrize("fields, what", [
    (dict(num_key_value_heads=2), "num_key_value_heads=2 is not read by HF's GPT-NeoX, which "
                                  "uses 4"),
    (dict(head_dim=8), "head_dim=8 is not read by HF's GPT-NeoX, which uses 16"),
    (dict(rope_parameters={"rope_theta": 1e4, "partial_rotary_factor": 0.1}),
     "gives 1 rotary dims of head_dim 16"),
    (dict(rotary_pct=1.5), r"must be a number in \(0, 1\], got 1.5")])
def test_gpt_neox_configs_kiln_would_misread_are_refused_naming_the_field(fields, what):
    """HF's GPT-NeoX ignores num_key_value_heads / head_dim, which Kiln's attention and KV
    cache read; a rotary share leaving an odd (or no) number of dims cannot be roped."""
    from kiln.config.hf_config_snapshot import HFConfigSnapshot
    from kiln.errors import ConfigError
    from kiln.model.gpt_neox import GPTNeoXAttention

    cfg = HFConfigSnapshot({"hidden_size": 64, "num_attention_heads": 4,
                            "max_position_embeddings": 64, **fields})
    with pytest.raises(ConfigError, match=what):
        GPTNeoXAttention(cfg, "model.layers.0.self_attn")


@pytest.mark.parametrize("arch", ["starcoder2", "gpt_neox"])
def test_lora_on_the_non_gated_mlp_families_is_refused_by_flag(arch, request):
    """Kiln's LoRA layers are q/k/v/o, gate/up/down (Phi's q/k/v, dense, fc1 / fc2): attaching
    them failed as an AttributeError (no mlp.gate_up_proj) once the model was loaded."""
    from kiln.config import DeviceConfig, KilnConfig, ModelConfig
    from kiln.errors import ConfigError
    from kiln.lora.config import LoRAConfig

    model_dir = request.getfixturevalue(f"tiny_{arch}_dir")
    with pytest.raises(ConfigError, match="--enable-lora: LoRA adapters on .*drop --enable-lora"):
        KilnConfig(ModelConfig(model=str(model_dir)), device_config=DeviceConfig("cpu"),
                   enforce_eager=True, lora_config=LoRAConfig())


def test_cohere_per_head_qk_norm_loads_this_ranks_heads():
    """Command-R+'s q / k norms hold a weight per head ([heads, head_dim]): a rank loads its
    heads' rows (the tp=2 runs with use_qk_norm matched HF through this)."""
    from kiln.errors import ConfigError
    from kiln.model.cohere import HeadLayerNorm

    whole = torch.arange(4 * 8, dtype=torch.float32).view(4, 8)
    norm = HeadLayerNorm(2, 8, 1e-5, shard=1, num_shards=2)
    norm.weight.weight_loader(norm.weight, whole)
    assert torch.equal(norm.weight, whole[2:])
    with pytest.raises(ConfigError, match="expected 4"):
        norm.weight.weight_loader(norm.weight, whole[:3])
