"""GGUF files Kiln cannot run, refused before transformers or the model's loading meets them:
each error names the file, what in it is wrong (the GGUF key and its value, the tensor) and what
to do, where they failed deep inside (a missing parameter, a ZeroDivisionError, transformers'
validator naming its own field)."""
import numpy as np
import pytest

from model._attn_helper import kiln_config_for
from model.test_gguf_vs_hf import write_gguf

from checkpoints import make_tiny_checkpoint


@pytest.fixture
def hf_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_CACHE_ROOT", str(tmp_path / "cache"))
    return make_tiny_checkpoint(tmp_path / "hf", "llama", tie=False)


def test_a_split_file_is_refused_saying_to_merge_it(hf_dir, tmp_path):
    """The first part failed with "checkpoint is missing 9 parameters", the others with "no
    general.architecture"."""
    write_gguf(tmp_path / "m.gguf", hf_dir, split_max_tensors=12)
    parts = sorted(tmp_path.glob("m-*-of-*.gguf"))
    assert len(parts) > 1
    for part in parts:
        with pytest.raises(ValueError, match=rf"{part.name} is one of {len(parts)} parts of a "
                                             r"split model \(split\.count = \d\).*"
                                             r"llama-gguf-split --merge"):
            kiln_config_for(part)


def test_a_mixture_of_experts_file_is_refused(hf_dir, tmp_path):
    """A Mixtral-style file (experts' stacked ffn_*_exps tensors for the dense MLP's) failed
    with "checkpoint is missing 6 parameter(s)"."""
    experts, dense = {}, []
    for layer in range(2):
        for part, shape in (("ffn_gate", (4, 128, 64)), ("ffn_up", (4, 128, 64)),
                            ("ffn_down", (4, 64, 128))):
            experts[f"blk.{layer}.{part}_exps.weight"] = np.zeros(shape, np.float32)
            dense.append(f"blk.{layer}.{part}.weight")
        experts[f"blk.{layer}.ffn_gate_inp.weight"] = np.zeros((4, 64), np.float32)
    import gguf

    path = write_gguf(tmp_path / "moe.gguf", hf_dir, extra=experts, skip=tuple(dense),
                      metadata={"llama.expert_count": (4, gguf.GGUFValueType.UINT32),
                                "llama.expert_used_count": (2, gguf.GGUFValueType.UINT32)})
    with pytest.raises(ValueError, match=r"moe\.gguf holds a mixture-of-experts model "
                                         r"\(llama\.expert_count = 4\); Kiln runs dense models"):
        kiln_config_for(path)
