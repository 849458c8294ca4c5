"""W8A8 int8 in bfloat16 on the torch references (custom_ops ["none"]): modes 0 and 3 give the
same greedy tokens. The references round to bfloat16 right before quantizing (rms_norm's
output, SiLU); Inductor fusing them kept float32 there, some 7-10% of the int8 values moved a
step, and a tiny Qwen3's tokens parted at the third step (logprobs by 0.57). Compiled with
emulate_precision_casts, which Kiln sets for exactly these models (kiln/config/
inductor_options.py), they match.
"""
import pytest
import torch
from transformers import Qwen3Config

from kiln import LLM, SamplingParams
from kiln.config import CompilationConfig, KilnConfig, ModelConfig
from kiln.config.inductor_options import INT8_ACT_QUANT_OPS, inductor_options
from kiln.ir.selection import resolve

from checkpoints import make_tiny_checkpoint, random_prompts
from w8a8_checkpoint import write_w8a8_checkpoint

LENGTHS = [1, 9, 40, 90]  # 90 > the 64-token budget: chunked prefill
NEW_TOKENS = 8
EMULATE = {"emulate_precision_casts": True}


@pytest.fixture(scope="module")
def w8a8_dir(tmp_path_factory):
    src = make_tiny_checkpoint(tmp_path_factory.mktemp("float"), "qwen3", tie=False)
    return write_w8a8_checkpoint(src, tmp_path_factory.mktemp("w8a8"))


def _run(model_dir, tmp_path, mode):
    llm = LLM(model=str(model_dir), dtype="bfloat16", max_num_batched_tokens=64, max_num_seqs=8,
              kv_cache_memory=0.05, compilation_config={
                  "mode": mode, "custom_ops": ["none"], "cache_dir": str(tmp_path / "cc")})
    prompts = random_prompts(len(LENGTHS), LENGTHS, seed=5)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return ([o.outputs[0].token_ids for o in outs],
            [[next(iter(s.values())).logprob for s in o.outputs[0].logprobs] for o in outs])


def test_modes_0_and_3_give_identical_greedy_tokens_on_torch_references(w8a8_dir, tmp_path):
    eager_tokens, eager_lp = _run(w8a8_dir, tmp_path, 0)
    compiled_tokens, compiled_lp = _run(w8a8_dir, tmp_path, 3)
    assert compiled_tokens == eager_tokens
    # Often bit-identical; RMSNorm's float32 sum order (Inductor's against ATen's) can still
    # move a value one bfloat16 / int8 step (0.016 seen in the suite's run). Without emulated
    # casts the logprobs moved by 0.57 and more.
    assert max(abs(a - b) for ra, rb in zip(eager_lp, compiled_lp)
               for a, b in zip(ra, rb)) < 0.1


def _config(dtype="bfloat16", quantization="int8", custom_ops=("none",), inductor=None):
    hf = Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, head_dim=16,
                     num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
                     max_position_embeddings=128)
    cc = CompilationConfig(custom_ops=list(custom_ops), inductor_compile_config=inductor or {})
    return KilnConfig(
        model_config=ModelConfig(model="unused", hf_config=hf, load_format="dummy",
                                 dtype=dtype, quantization=quantization),
        compilation_config=cc)


def _options(**kw):
    return inductor_options(_config(**kw))


def test_emulated_casts_only_for_int8_on_torch_references_in_16_bit():
    assert _options() == EMULATE
    assert _options(dtype="float16") == EMULATE
    assert _options(custom_ops=["-rms_norm_dynamic_int8_quant"]) == EMULATE
    assert _options(quantization=None) == {}  # a float model compiles as before
    assert _options(dtype="float32") == {}
    # the user's value wins, and their other options are kept
    assert _options(inductor={"emulate_precision_casts": False}) == {
        "emulate_precision_casts": False}
    assert _options(inductor={"size_asserts": True}) == {**EMULATE, "size_asserts": True}
    native = resolve({}, "cpu", torch.bfloat16).as_dict()
    if all(native[op] == "native" for op in INT8_ACT_QUANT_OPS):  # the kernels quantize
        assert _options(custom_ops=()) == {}


def test_the_cache_key_holds_the_emulated_casts():
    """Artifacts compiled before Kiln set the option must not load for the model now."""
    assert _config().compute_hash() == _config(inductor=EMULATE).compute_hash()
    assert _config().compute_hash() != _config(
        inductor={"emulate_precision_casts": False}).compute_hash()


def _family_config(arch: str, dtype: str):
    import transformers

    config_cls = {"gemma": "GemmaConfig", "olmo2": "Olmo2Config", "llama": "LlamaConfig"}[arch]
    hf = getattr(transformers, config_cls)(hidden_size=64, intermediate_size=128,
                                           num_hidden_layers=2, num_attention_heads=4,
                                           num_key_value_heads=2, vocab_size=256,
                                           max_position_embeddings=128)
    hf.architectures = [f"{config_cls[:-len('Config')]}ForCausalLM"]
    return KilnConfig(model_config=ModelConfig(model="unused", hf_config=hf, load_format="dummy",
                                               dtype=dtype))


def test_emulated_casts_for_16_bit_families_whose_norms_round_as_hf_does():
    """Gemma and OLMo-2's norms are torch references rounding to the model dtype; without the
    emulated casts their bfloat16 logprobs in mode 3 differed from mode 0's by up to 0.03."""
    assert inductor_options(_family_config("gemma", "bfloat16")) == EMULATE
    assert inductor_options(_family_config("olmo2", "float16")) == EMULATE
    assert inductor_options(_family_config("gemma", "float32")) == {}
    assert inductor_options(_family_config("llama", "bfloat16")) == {}
