"""Checkpoints the residual-rotation tests share (test_residual_rotation.py, the engine paths in
test_rotation_paths.py)."""
import pytest
from safetensors.torch import load_file, save_file

from checkpoints import make_tiny_checkpoint, with_random_norms_and_biases


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory):
    """A tiny Llama, hidden 192 (64 x 3: Q = H_64 (x) a random 3 x 3, the default model's
    576 = 64 x 9 form), head_dim 32 (v / o rotated per head too), norm weights other than 1
    (HF initialises them to 1, which folding would not test) and one stream channel 20x the
    rest, as real models have: what the rotation spreads."""
    path = with_random_norms_and_biases(make_tiny_checkpoint(
        tmp_path_factory.mktemp("rot"), "llama", tie=True, hidden_size=192,
        num_attention_heads=6, num_key_value_heads=2))
    file = path / "model.safetensors"
    tensors = load_file(file)
    tensors["model.embed_tokens.weight"][:, 7] *= 20
    save_file(tensors, file, metadata={"format": "pt"})
    return path
