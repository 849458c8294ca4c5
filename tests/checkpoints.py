"""Tiny random-weight HF checkpoints (ARCH_CONFIGS: Llama, Qwen2, Qwen3, Phi-3, Granite, Gemma,
OLMo-2, StarCoder2, GPT-NeoX, Phi, Cohere, Gemma-2, Gemma-3, OLMo-3, SmolLM3, EXAONE-4, GLM-4,
Seed-OSS, ERNIE-4.5, Mistral with a sliding window, and the MoEs Mixtral, Qwen2-MoE, Qwen3-MoE)
and the HF greedy oracle for tests.

Imported by tests as `checkpoints` (pytest puts tests/ on sys.path through the root conftest).
"""
import os
from pathlib import Path

import torch

# A real trained 260K-parameter Llama shipped with the tests (tests/fixtures/stories260K/README.md).
STORIES_DIR = Path(__file__).resolve().parent / "fixtures" / "stories260K"

# Keep tests deterministic and light on a 2-core machine.
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


def save_tiny_tokenizer(path: Path, vocab_size: int = 512) -> None:
    """A word-level tokenizer over `vocab_size` made-up words ("w3" ... ), with <unk>, <s>, </s>
    at ids 0, 1, 2, so tests need no files from outside the repository."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, vocab_size)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tok = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="<s>", eos_token="</s>",
                                  unk_token="<unk>")
    tok.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n"
                         "{% endfor %}{% if add_generation_prompt %}assistant:{% endif %}")
    tok.save_pretrained(path)


# A Qwen2.5 / Qwen3-shaped chat template: tools in the system turn, <tool_call> blocks in
# assistant turns, tool results as <tool_response>, and Qwen3's enable_thinking switch.
QWEN_STYLE_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n"
    "{{ messages[0].content if messages[0].role == 'system' else 'You are helpful.' }}"
    "\n\n# Tools\n<tools>{% for tool in tools %}\n{{ tool | tojson }}{% endfor %}\n</tools>"
    "\nFor each function call, return a json object within <tool_call></tool_call> tags:\n"
    "<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n"
    "</tool_call><|im_end|>\n"
    "{%- elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}"
    "<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'user' or (m.role == 'system' and not loop.first)"
    " or (m.role == 'assistant' and not m.tool_calls) %}"
    "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
    "{%- elif m.role == 'assistant' %}<|im_start|>assistant"
    "{% if m.content %}\n{{ m.content }}{% endif %}"
    "{% for tc in m.tool_calls %}{% set f = tc.function if tc.function is defined else tc %}"
    "\n<tool_call>\n{\"name\": \"{{ f.name }}\", \"arguments\": {{ f.arguments | tojson }}}"
    "\n</tool_call>{% endfor %}<|im_end|>\n"
    "{%- elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}"
    "\n</tool_response><|im_end|>\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% endif %}{%- endif %}")


def save_chat_tokenizer(path: Path) -> None:
    """A byte-level BPE tokenizer (every string has a spelling, so JSON and tool calls can be
    generated) with Qwen's <|im_start|> / <|im_end|> (eos), <tool_call> and <think> tokens and
    QWEN_STYLE_TEMPLATE; about 350 ids, trained on a fixed corpus (deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=340, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    corpus = ['{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}',
              "The quick brown fox jumps over the lazy dog: true, false, null, 0123456789."]
    core.train_from_iterator(corpus * 8, trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<|im_end|>",
                                  pad_token="<|endoftext|>")
    tok.add_tokens(["<tool_call>", "</tool_call>", "<think>", "</think>"])
    tok.chat_template = QWEN_STYLE_TEMPLATE
    tok.save_pretrained(path)


# arch -> (transformers config class, fields each tiny checkpoint of it sets)
ARCH_CONFIGS = {
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", {}),  # q/k/v projections carry a bias
    "qwen3": ("Qwen3Config", {"head_dim": 16}),  # per-head q/k RMSNorm, explicit head_dim
    "phi3": ("Phi3Config", {"sliding_window": None, "pad_token_id": 0}),  # fused qkv, gate_up
    # every multiplier away from 1 (attention_multiplier: the softmax scale, not hd ** -0.5)
    "granite": ("GraniteConfig", {"embedding_multiplier": 3.0, "residual_multiplier": 0.6,
                                  "attention_multiplier": 0.15, "logits_scaling": 1.5}),
    # head_dim 32 (not hidden / heads), GeGLU, (1 + w) norms, sqrt(hidden)-scaled embeddings
    "gemma": ("GemmaConfig", {"head_dim": 32, "pad_token_id": 0}),
    "olmo2": ("Olmo2Config", {"pad_token_id": 0}),  # post-block norms, whole-projection q/k norms
    # LayerNorms with biases, biased linears, a GELU (tanh) MLP; a window of 8 in every layer
    "starcoder2": ("Starcoder2Config", {"sliding_window": 8, "pad_token_id": 0}),
    # Pythia: parallel residual, rope over a quarter of each head, fused per-head
    # query_key_value, exact GELU; HF's GPT-NeoX has no KV-head grouping (the common 2 dropped)
    "gpt_neox": ("GPTNeoXConfig", {"rotary_pct": 0.25, "pad_token_id": 0,
                                   "num_key_value_heads": None}),
    # Phi-2: one LayerNorm feeding attention and a gelu_new MLP in parallel, rope over half of
    # each head, biases everywhere (the LM head's too)
    "phi": ("PhiConfig", {"partial_rotary_factor": 0.5, "pad_token_id": 0}),
    # Command-R: a bias-free LayerNorm feeding attention and a SiLU-gated MLP in parallel,
    # rope over interleaved pairs, logits scaled
    "cohere": ("CohereConfig", {"logit_scale": 0.5, "pad_token_id": 0}),
    # mixtures of experts: 4 experts, top 2; Mixtral renormalizes always
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    # a sigmoid-gated shared expert, routing weights not renormalized, layer 1 dense
    "qwen2_moe": ("Qwen2MoeConfig", {"num_experts": 4, "num_experts_per_tok": 2,
                                     "moe_intermediate_size": 32,
                                     "shared_expert_intermediate_size": 48,
                                     "mlp_only_layers": [1]}),
    "qwen3_moe": ("Qwen3MoeConfig", {"num_experts": 4, "num_experts_per_tok": 2,
                                     "moe_intermediate_size": 32, "head_dim": 16,
                                     "norm_topk_prob": True}),
    # DeepSeek-V2(-Lite): latent attention without a q LoRA (V 16 beside K 24: padded in the
    # cache), 8 experts in 4 groups (2 chosen) top 2, a shared expert, layer 0 dense, 3 layers
    "deepseek_v2": ("DeepseekV2Config", {**(_DEEPSEEK := {
        "num_key_value_heads": 4, "num_hidden_layers": 3, "n_routed_experts": 8,
        "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_shared_experts": 1,
        "first_k_dense_replace": 1, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8, "v_head_dim": 16, "n_group": 4, "topk_group": 2}),
        "q_lora_rank": None, "topk_method": "group_limited_greedy",
        "routed_scaling_factor": 1.5}),
    # DeepSeek-V2 with a q LoRA and DeepSeek's YaRN (mscale_all_dim scales the softmax too);
    # greedy routing
    "deepseek_v2_yarn": ("DeepseekV2Config", {**_DEEPSEEK, "q_lora_rank": 24,
                                              "topk_method": "greedy",
                                              "rope_parameters": {
                                                  "rope_type": "yarn", "rope_theta": 10000.0,
                                                  "factor": 4.0, "mscale": 0.707,
                                                  "mscale_all_dim": 0.707, "beta_fast": 32,
                                                  "beta_slow": 1,
                                                  "original_max_position_embeddings": 128}}),
    # DeepSeek-V3: noaux_tc (sigmoid scores, a random e_score_correction_bias), renormalized
    # and scaled by 2.5, q LoRA, rope over interleaved pairs
    "deepseek_v3": ("DeepseekV3Config", {**_DEEPSEEK, "q_lora_rank": 24, "norm_topk_prob": True,
                                         "routed_scaling_factor": 2.5}),
    # a sliding window of 8 in every layer, so 20-40 token prompts outgrow it
    "mistral_window": ("MistralConfig", {"sliding_window": 8}),
    # sliding (window 8) and global layers alternating, pre/post block norms, scale from
    # query_pre_attn_scalar; soft caps small enough to bite on a tiny random model's scores
    "gemma2": ("Gemma2Config", {"head_dim": 16, "sliding_window": 8, "query_pre_attn_scalar": 24,
                                "attn_logit_softcapping": 2.0, "final_logit_softcapping": 3.0,
                                "pad_token_id": 0}),
    # Gemma-2's blocks plus per-head (1 + w) q/k norms; sliding (window 8) and global layers
    # alternating, each kind roped its own way: local base 100, global 10000 linearly scaled x4
    "gemma3": ("Gemma3TextConfig", {"head_dim": 16, "sliding_window": 8,
                                    "sliding_window_pattern": 2, "query_pre_attn_scalar": 24,
                                    "rope_local_base_freq": 100.0, "rope_theta": 10000.0,
                                    "rope_scaling": {"rope_type": "linear", "factor": 4.0},
                                    "pad_token_id": 0}),
    # OLMo-2's layers, a sliding (window 8, rope base 100) and a global layer (10000, linear x2)
    "olmo3": ("Olmo3Config", {"sliding_window": 8, "pad_token_id": 0,
                              "layer_types": ["sliding_attention", "full_attention"],
                              "rope_parameters": {
                                  "sliding_attention": {"rope_type": "default",
                                                        "rope_theta": 100.0},
                                  "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                     "rope_theta": 10000.0}}}),
    # layer 1 NoPE
    "smollm3": ("SmolLM3Config", {"no_rope_layers": [1, 0], "pad_token_id": 0}),
    # post-block norms, per-head q/k norms; a sliding layer (window 8, roped), a global NoPE one
    "exaone4": ("Exaone4Config", {"sliding_window": 8, "pad_token_id": 0,
                                  "layer_types": ["sliding_attention", "full_attention"]}),
    # sandwich norms, interleaved rope over half of each head, q/k/v biases, fused gate_up
    "glm4": ("Glm4Config", {"head_dim": 16, "attention_bias": True, "pad_token_id": 0}),
    # q/k/v biases and the o_proj's own
    "seed_oss": ("SeedOssConfig", {"head_dim": 16, "attention_bias": True,
                                   "attention_out_bias": True, "pad_token_id": 0}),
    # interleaved rope, use_bias on every linear
    "ernie4_5": ("Ernie4_5Config", {"head_dim": 16, "use_bias": True, "pad_token_id": 0}),
}


# Families whose biases and norm weights are drawn at random too (HF initialises them to 0 and
# 1), so that one loaded into the wrong place, or the wrong rank's share, shows in the tokens.
_RANDOM_BIASES = ("starcoder2", "gpt_neox", "phi", "cohere", "olmo3", "smollm3", "exaone4",
                  "glm4", "seed_oss", "ernie4_5")


def _widened(model, biases: bool = False):
    """Random init is tiny; widen it so greedy tokens are decisive rather than near-ties."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            # (norms first: Cohere's q / k norms hold a [heads, head_dim] weight)
            if biases and "norm" in name and name.endswith(".weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif p.dim() > 1:
                p.normal_(0, 0.08)
            elif biases:
                p.normal_(0, 0.05)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # DeepSeek-V3's routing bias
                b.normal_(0, 0.1)
    return model


def make_tiny_checkpoint(path: Path, arch: str, *, tie: bool, seed: int = 0,
                         tokenizer: str = "words", **overrides) -> Path:
    """Save a tiny random `arch` (a key of ARCH_CONFIGS) checkpoint and a tokenizer:
    "words" (save_tiny_tokenizer) or "chat" (save_chat_tokenizer, eos <|im_end|>)."""
    import transformers
    from transformers import AutoModelForCausalLM

    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                  max_position_embeddings=512, tie_word_embeddings=tie, bos_token_id=1,
                  eos_token_id=2)
    if arch not in ARCH_CONFIGS:
        raise ValueError(arch)
    config_cls, extra = ARCH_CONFIGS[arch]
    # an arch's own fields win over the common ones; None there drops a common field its
    # config lacks (GPT-NeoX's num_key_value_heads)
    dropped = {k for k, v in extra.items() if v is None and k in common}
    common = {k: v for k, v in {**common, **extra, **overrides}.items()
              if k not in dropped or k in overrides}
    config = getattr(transformers, config_cls)(**common)
    torch.manual_seed(seed)
    model = _widened(AutoModelForCausalLM.from_config(config, dtype=torch.float32),
                     biases=arch in _RANDOM_BIASES)
    if tokenizer == "chat":  # its <|im_end|> is id 2, the config's eos
        save_chat_tokenizer(path)
    else:
        save_tiny_tokenizer(path, common["vocab_size"])
    model.save_pretrained(path, safe_serialization=True)
    return path


def with_random_norms_and_biases(path: Path, seed: int = 1) -> Path:
    """Rewrite a tiny checkpoint's norm weights as 1 + 0.5 N(0, 1) and its biases as 0.1 N(0, 1)
    (HF initialises them to 1 and 0, which a transform folding norms into linears, or moving
    biases, would not test)."""
    from safetensors.torch import load_file, save_file

    file = path / "model.safetensors"
    tensors = load_file(file)
    g = torch.Generator().manual_seed(seed)
    for name, t in tensors.items():
        if "norm" in name:
            tensors[name] = 1 + 0.5 * torch.randn(t.shape, generator=g)
        elif name.endswith(".bias"):
            tensors[name] = 0.1 * torch.randn(t.shape, generator=g)
    save_file(tensors, file, metadata={"format": "pt"})
    return path


def make_tiny_classifier(path: Path, arch: str, num_labels: int, seed: int = 0,
                         **overrides) -> Path:
    """A tiny random HF `arch` *ForSequenceClassification checkpoint (a score head of
    `num_labels` over the last token; no pad token, so HF pools the last one as vLLM does)
    with the word tokenizer."""
    import transformers
    from transformers import AutoModelForSequenceClassification

    config_cls, extra = ARCH_CONFIGS[arch]
    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                  max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=1,
                  eos_token_id=2, num_labels=num_labels, pad_token_id=None)
    config = getattr(transformers, config_cls)(**{**extra, **common, **overrides})
    torch.manual_seed(seed)
    model = _widened(AutoModelForSequenceClassification.from_config(config, dtype=torch.float32))
    save_tiny_tokenizer(path, common["vocab_size"])
    model.save_pretrained(path, safe_serialization=True)
    return path


# (checkpoint signature, prompt, max_new_tokens, attn_implementation) -> HF's continuation:
# many tests ask the oracle the same question of the same session checkpoint (HF's generate
# costs tens of ms a token here), and a greedy run of one prompt depends on nothing else.
_HF_GREEDY_CACHE: dict[tuple, list[int]] = {}


def _checkpoint_signature(model_dir: Path) -> tuple:
    """The checkpoint's directory and each file's name, size and mtime: a checkpoint rewritten
    in place is a new one."""
    root = Path(model_dir).resolve()
    files = sorted(p for p in root.iterdir() if p.is_file())
    return (str(root), *((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files))


def hf_greedy(model_dir: Path, prompts: list[list[int]], max_new_tokens: int,
              attn_implementation: str | None = None,
              dtype: torch.dtype = torch.float32) -> list[list[int]]:
    """HF transformers' greedy continuation of each prompt, EOS ignored (as Kiln's ignore_eos):
    exactly max_new_tokens each. One prompt at a time, so no padding enters the oracle; each
    answer is remembered for the session (_HF_GREEDY_CACHE).
    attn_implementation: HF's ("eager" for its plain masked softmax; None: its default); dtype:
    the one HF runs in."""
    signature = _checkpoint_signature(model_dir)
    keys = [(signature, tuple(ids), max_new_tokens, attn_implementation, dtype) for ids in prompts]
    missing = [(key, ids) for key, ids in zip(keys, prompts) if key not in _HF_GREEDY_CACHE]
    if missing:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=dtype, attn_implementation=attn_implementation).eval()
        # No EOS at all: min_new_tokens would instead mask EOS out of the argmax.
        model.generation_config.eos_token_id = None
        with torch.no_grad():
            for key, ids in missing:
                x = torch.tensor([ids])
                y = model.generate(x, max_new_tokens=max_new_tokens, do_sample=False,
                                   pad_token_id=0)
                _HF_GREEDY_CACHE[key] = y[0, len(ids):].tolist()
    return [list(_HF_GREEDY_CACHE[key]) for key in keys]


def greedy_tokens_and_logprobs(llm, prompts: list[list[int]], new_tokens: int):
    """Each token-id prompt's greedy tokens from `llm` (eos ignored) and each token's logprob."""
    from kiln import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    tokens = [o.outputs[0].token_ids for o in outs]
    logprobs = [[next(iter(step.values())).logprob for step in o.outputs[0].logprobs]
                for o in outs]
    return tokens, logprobs


def random_prompts(n: int, lengths: list[int], vocab: int = 512, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (lengths[i % len(lengths)],), generator=g).tolist()
            for i in range(n)]
