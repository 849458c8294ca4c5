"""One tiny Llama, two hand-written PEFT adapters and HF transformers' answers on the merged
weights, shared by the LoRA tests."""
import pytest
import torch
from lora_adapters import greedy, merged_model, write_adapter

from kiln.lora.request import LoRARequest

from checkpoints import make_tiny_checkpoint, random_prompts

MAX_TOKENS = 6


@pytest.fixture(scope="session")
def lora_setup(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    d = tmp_path_factory.mktemp("lora")
    base = make_tiny_checkpoint(d / "base", "llama", tie=False)
    adapters = {"a1": write_adapter(d / "a1", base, seed=1),  # every projection, r=4
                "a2": write_adapter(d / "a2", base, seed=2, rank=8, alpha=16, use_rslora=True,
                                    targets=("q_proj", "v_proj", "gate_proj", "down_proj"))}
    prompts = random_prompts(3, [5, 9, 21])
    models = {None: AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()}
    models.update({name: merged_model(base, path) for name, path in adapters.items()})
    refs = {name: greedy(model, prompts, MAX_TOKENS) for name, model in models.items()}
    # the adapters change the answers (else the tests prove nothing)
    assert refs["a1"] != refs[None] and refs["a2"] != refs[None] and refs["a1"] != refs["a2"]
    loras = {name: LoRARequest(name, i, str(path))
             for i, (name, path) in enumerate(adapters.items(), start=1)}
    return dict(base=base, prompts=prompts, refs=refs, loras=loras, models=models,
                adapters=adapters)
