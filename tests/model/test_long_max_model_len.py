"""VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 (Kiln's KILN_ALLOW_LONG_MAX_MODEL_LEN): a --max-model-len past
the model's own length is served with a warning, as vLLM's, and the positions past it are
computed as HF computes them (the rotary cache covers them)."""
import pytest

from model.test_model_configs_vs_hf import TOL, kiln_config_for, make_checkpoint, max_logit_diff


def test_a_longer_max_model_len_is_served_when_allowed(tmp_path, monkeypatch, kiln_logs):
    monkeypatch.delenv("KILN_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    monkeypatch.delenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", raising=False)
    path = make_checkpoint(tmp_path / "m", "LlamaConfig", max_position_embeddings=16)
    with pytest.raises(ValueError, match=r"max_model_len=40 exceeds the model's "
                       r"max_position_embeddings=16; .*set KILN_ALLOW_LONG_MAX_MODEL_LEN=1"):
        kiln_config_for(path, max_model_len=40)
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")
    assert kiln_config_for(path, max_model_len=40).model_config.max_model_len == 40
    assert ("max_model_len=40 exceeds the model's max_position_embeddings=16; served as "
            "VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 asks") in kiln_logs.text
    # past the trained 16 positions, HF's logits (its rotary angles for any position)
    assert max_logit_diff(path, seq_len=36, max_model_len=40) < TOL
    monkeypatch.setenv("KILN_ALLOW_LONG_MAX_MODEL_LEN", "0")  # Kiln's wins where both are set
    with pytest.raises(ValueError, match="set KILN_ALLOW_LONG_MAX_MODEL_LEN=1"):
        kiln_config_for(path, max_model_len=40)
