"""Which layers rope and which slide, for the families that decide it per layer (SmolLM3's NoPE
layers, EXAONE-4's NoPE global layers, OLMo-3's windows and ropes by layer type), as HF's
classes do; the refusals of what Kiln does not run for them; classifier architectures keyed by
their backbone family."""
import pytest

from kiln.config.hf_config_snapshot import HFConfigSnapshot
from kiln.config.sliding_window import layer_sliding_windows
from kiln.errors import ConfigError
from kiln.model.nope import layer_uses_rope


def test_smollm3_and_exaone4_nope_layers_are_hfs():
    from transformers import Exaone4Config, SmolLM3Config

    # SmolLM3: every fourth layer NoPE by default, or as no_rope_layers lists
    assert [layer_uses_rope(SmolLM3Config(num_hidden_layers=8), i) for i in range(8)] == \
        [True, True, True, False] * 2
    explicit = SmolLM3Config(num_hidden_layers=3, no_rope_layers=[0, 1, 1])
    assert [layer_uses_rope(explicit, i) for i in range(3)] == [False, True, True]
    # EXAONE-4: with a window only the sliding layers rope; without one every layer
    hybrid = Exaone4Config(num_hidden_layers=4, sliding_window=16, sliding_window_pattern=4)
    assert [layer_uses_rope(hybrid, i) for i in range(4)] == [True, True, True, False]
    assert layer_sliding_windows(hybrid, "Exaone4ForCausalLM") == [16, 16, 16, None]
    full = Exaone4Config(num_hidden_layers=2, sliding_window=None,
                         layer_types=["full_attention"] * 2)
    assert [layer_uses_rope(full, i) for i in range(2)] == [True, True]
    assert layer_sliding_windows(full, "Exaone4ForCausalLM") == [None, None]
    # other families rope every layer
    assert layer_uses_rope(HFConfigSnapshot({"model_type": "llama", "num_hidden_layers": 2}), 1)


@pytest.mark.parametrize("fields, what", [
    ({"model_type": "smollm3", "num_hidden_layers": 3, "no_rope_layers": [1, 0]},
     "no_rope_layers names 2 layers, num_hidden_layers is 3"),
    ({"model_type": "exaone4", "num_hidden_layers": 2, "sliding_window": 8},
     "needs layer_types naming each of its 2 layers")])
def test_nope_configs_kiln_cannot_read_are_refused_naming_the_field(fields, what):
    with pytest.raises(ConfigError, match=what):
        layer_uses_rope(HFConfigSnapshot(fields), 0)


def test_windows_of_olmo3_and_smollm3_follow_layer_types():
    from transformers import Olmo3Config, SmolLM3Config

    olmo3 = Olmo3Config(num_hidden_layers=4, sliding_window=32)
    assert layer_sliding_windows(olmo3, "Olmo3ForCausalLM") == [32, 32, 32, None]
    assert layer_sliding_windows(olmo3, "Olmo3ForSequenceClassification") == [32, 32, 32, None]
    # SmolLM3's window is off unless use_sliding_window (as Qwen's)
    assert layer_sliding_windows(SmolLM3Config(num_hidden_layers=2, sliding_window=8),
                                 "SmolLM3ForCausalLM") == [None, None]


def test_classifier_architectures_map_to_their_backbone_family():
    """Gemma-3's text classifier is Gemma3Text*; its windows, MoE and LoRA checks are the
    family's (they were keyed by a name made from the classifier's, Gemma3Text*ForCausalLM)."""
    from kiln.model.registry import causal_architecture, get_model_class

    assert causal_architecture("Gemma3TextForSequenceClassification") == "Gemma3ForCausalLM"
    assert causal_architecture("MixtralForSequenceClassification") == "MixtralForCausalLM"
    assert get_model_class("Glm4ForSequenceClassification").__name__ == \
        "Glm4ForSequenceClassification"
    config = HFConfigSnapshot({"sliding_window": 4, "num_hidden_layers": 2,
                               "layer_types": ["sliding_attention", "full_attention"]})
    assert layer_sliding_windows(config, "Gemma3TextForSequenceClassification") == [4, None]
