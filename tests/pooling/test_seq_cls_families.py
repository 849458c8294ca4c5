"""Every family's *ForSequenceClassification (vLLM serves them all by HF's class name) scores as
HF transformers' on a tiny random checkpoint: float32 logits of the last token of each prompt
in one paged prefill of two, within ATOL."""
import pytest
import torch
from model._attn_helper import BlockPool, PagedRequest, allocate_kv_caches, build_step, kiln_config_for

from kiln.model.loader import get_model
from pooling.hf_pooled import hf_logits

from checkpoints import make_tiny_classifier, random_prompts

ATOL = 1e-4  # float32 both sides; observed under 1e-5
# ARCH_CONFIGS key -> the classifier's own overrides (HF's GPT-NeoX groups no KV heads)
FAMILIES = {"mistral_window": {}, "gemma": {}, "gemma2": {}, "gemma3": {},
            "gpt_neox": {"num_key_value_heads": 4}, "starcoder2": {}, "phi": {}, "phi3": {},
            "mixtral": {}, "qwen2_moe": {}, "qwen3_moe": {}, "olmo2": {}, "olmo3": {},
            "smollm3": {}, "exaone4": {}, "seed_oss": {}, "glm4": {}}


@pytest.mark.parametrize("arch", sorted(FAMILIES))
def test_family_classifier_scores_match_hf(arch, tmp_path):
    from kiln.forward_context import set_forward_context
    from kiln.model.layers.attention import attention_layers

    path = make_tiny_classifier(tmp_path / arch, arch, 3, **FAMILIES[arch])
    cfg = kiln_config_for(path)
    assert cfg.model_config.architecture.endswith("ForSequenceClassification")
    model = get_model(cfg)
    allocate_kv_caches(model, cfg, 32, 4)
    prompts = random_prompts(2, [7, 30], seed=2)  # 30: past the windowed families' 8
    ids, pos, md = build_step(BlockPool(32, 4), [PagedRequest(p) for p in prompts],
                              [len(p) for p in prompts])
    with torch.no_grad(), set_forward_context(md, cfg, layers=attention_layers(model)):
        hidden = model(ids, pos)  # [37, hidden]
    got = model.classify(hidden[[len(prompts[0]) - 1, -1]])  # [2, 3]
    torch.testing.assert_close(got, torch.stack(hf_logits(path, prompts)), atol=ATOL, rtol=0)
