"""DeepSeek-V2 (no q LoRA, group_limited_greedy, layer 0 dense; with a q LoRA and YaRN) and V3
(noaux_tc, a routing bias, renormalized) against HF transformers on tiny random float32
checkpoints: logits of a prefill and of decode steps through the paged cache within 1e-4;
through LLM greedy tokens equal HF's and logprobs HF's log-softmax within 1e-4, eager (mode 0)
and, for V3, compiled (mode 3); MTP layers skipped; what the family refuses, by field.
"""
import pytest
import torch

from kiln import LLM
from kiln.errors import ConfigError
from model.test_moe_vs_hf import _assert_logits_match_hf, _check_against_hf, _generate
from model._attn_helper import kiln_config_for

ARCHS = ["deepseek_v2", "deepseek_v2_yarn", "deepseek_v3"]


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_and_decode_logits_match_hf(arch, request):
    _assert_logits_match_hf(request.getfixturevalue(f"tiny_{arch}_dir"))


def test_v2_eager_greedy_and_logprobs_match_hf(tiny_deepseek_v2_dir):
    llm = LLM(model=str(tiny_deepseek_v2_dir), dtype="float32", enforce_eager=True,
              max_model_len=64)
    _check_against_hf(_generate(llm), tiny_deepseek_v2_dir)


def test_v3_mode3_matches_hf(tiny_deepseek_v3_dir, inprocess_core):
    """Traced whole (Dynamo, Kiln's passes and piecewise split); the eager backend keeps
    Inductor's minute of compiling out of the suite."""
    llm = LLM(model=str(tiny_deepseek_v3_dir), dtype="float32", max_model_len=64,
              compilation_config={"mode": 3, "backend": "eager"})
    _check_against_hf(_generate(llm), tiny_deepseek_v3_dir)
