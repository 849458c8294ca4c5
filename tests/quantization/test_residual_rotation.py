"""The residual-stream rotation (kiln/model/residual_rotation.py; online int8's default on a
Llama model): the rotation is orthogonal and deterministic; a float model so transformed gives
the unrotated model's greedy tokens, its logprobs within 2e-4 in float32 and 0.1 in bfloat16
(0.052 measured: weights and stream rounded after the rotation); online int8 with it gives the
same greedy tokens eagerly and compiled; an explicit --quantization-rotation hadamard is refused
where it cannot apply, naming the flag (each case of auto's resolution:
tests/config/test_quantization_rotation.py).
"""
import pytest
import torch

from kiln import LLM
from kiln.benchmarks.engine_probe import engine_model
from kiln.engine.arg_utils import EngineArgs
from kiln.errors import ConfigError
from kiln.model import residual_rotation as rr

from checkpoints import greedy_tokens_and_logprobs, random_prompts

LENGTHS = [1, 9, 40, 90]  # 90 > the 64-token budget: chunked prefill
NEW_TOKENS = 8

pytestmark = pytest.mark.usefixtures("inprocess_core")  # the model is read off the engine
# llama_dir: conftest.py


def _run(model_dir, tmp_path, mode=0, dtype="float32", **kw):
    llm = LLM(model=str(model_dir), dtype=dtype, max_num_batched_tokens=64, max_num_seqs=8,
              kv_cache_memory=0.05, compilation_config={
                  "mode": mode, "cache_dir": str(tmp_path / "cc")}, **kw)
    tokens, logprobs = greedy_tokens_and_logprobs(
        llm, random_prompts(len(LENGTHS), LENGTHS, seed=5), NEW_TOKENS)
    rotated = engine_model(llm.llm_engine).model.residual_rotation is not None
    llm.llm_engine.shutdown()
    return tokens, logprobs, rotated


def _max_diff(a, b):
    return max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra, rb))


@pytest.mark.parametrize("d, block", [(576, 64), (192, 64), (64, 64), (96, 32), (256, 64)])
def test_rotation_is_orthogonal_and_deterministic(d, block):
    assert rr.hadamard_block(d) == block
    q = rr.rotation_matrix(d)
    assert q.shape == (d, d) and q.dtype == torch.float64
    assert torch.allclose(q @ q.t(), torch.eye(d, dtype=torch.float64), atol=1e-12)
    assert torch.equal(q, rr.rotation_matrix(d))
    # every entry spread: no stream channel stays where it was
    assert q.abs().max() < 0.5
    if d // block > 1:
        assert not torch.equal(q, rr.rotation_matrix(d, seed=1))


@pytest.mark.parametrize("d", [576, 192, 96, 64])
def test_factored_products_equal_the_dense_ones(d):
    """The load-time transform multiplies by Q through its factors (d (b + m) a row, not d^2)."""
    rot = rr.stream_rotation(d)
    q = rot.dense()
    g = torch.Generator().manual_seed(2)
    w, v = (torch.randn(shape, generator=g, dtype=torch.float64) for shape in ((7, d), (d, 5)))
    assert torch.allclose(rot.right(w), w @ q, atol=1e-12)
    assert torch.allclose(rot.left_t(v), q.t() @ v, atol=1e-12)
    dense = rr.Rotation(q, torch.ones(1, 1))  # a dense Q, as rotate_llama takes one
    assert torch.allclose(dense.right(w), w @ q, atol=1e-12)
    assert torch.allclose(dense.left_t(v), q.t() @ v, atol=1e-12)


def test_hadamard_needs_a_power_of_two():
    h = rr.hadamard(8)
    assert torch.allclose(h.abs(), torch.full((8, 8), 8 ** -0.5, dtype=torch.float64))
    assert torch.allclose(h @ h.t(), torch.eye(8, dtype=torch.float64))
    with pytest.raises(ValueError, match="power of two"):
        rr.hadamard(12)


@pytest.mark.parametrize("dtype, tolerance", [("float32", 2e-4), ("bfloat16", 0.1)])
def test_rotated_float_model_matches_unrotated(llama_dir, tmp_path, monkeypatch, dtype,
                                               tolerance):
    """The transform is exact in real arithmetic: forced onto a float model (the flag itself
    asks for int8), the tokens stay and the logprobs move by rounding only."""
    tokens, logprobs, rotated = _run(llama_dir, tmp_path, dtype=dtype)
    assert not rotated
    monkeypatch.setattr(rr, "apply_rotation", lambda model, rotation: rr.rotate_llama(
        model, rr.rotation_matrix(model.model.norm.weight.shape[0])))  # a dense Q
    rot_tokens, rot_logprobs, rotated = _run(llama_dir, tmp_path, dtype=dtype)
    assert rotated
    assert rot_tokens == tokens
    assert _max_diff(rot_logprobs, logprobs) < tolerance


def test_int8_rotation_modes_0_and_3_give_identical_greedy_tokens(llama_dir, tmp_path):
    kw = {"quantization": "int8"}  # rotated as shipped (quantization_rotation "auto")
    eager_tokens, eager_lp, rotated = _run(llama_dir, tmp_path, 0, **kw)
    assert rotated
    compiled_tokens, compiled_lp, rotated = _run(llama_dir, tmp_path, 3, **kw)
    assert rotated and compiled_tokens == eager_tokens
    # the int8 path ran, close to the float model's
    _, float_lp, _ = _run(llama_dir, tmp_path, 0)
    assert 0 < _max_diff(eager_lp, float_lp) < 0.5


@pytest.mark.parametrize("kw, message", [
    ({"quantization_rotation": "hadamard"}, "needs --quantization int8"),
    ({"quantization_rotation": "hadamard", "quantization": "fp8"},
     "needs --quantization int8 \\(got quantization='fp8'\\)"),
    ({"quantization_rotation": "givens", "quantization": "int8"},
     "--quantization-rotation\\) must be one of auto, hadamard, none"),
    ({"quantization_rotation": "hadamard", "quantization": "int8",
      "pipeline_parallel_size": 2}, "runs on one pipeline stage only.*-pp 2"),
    ({"quantization_rotation": "hadamard", "quantization": "int8", "enable_lora": True},
     "LoRA adapters.*drop --enable-lora"),
    ({"quantization_rotation": "hadamard", "quantization": "int8", "runner": "pooling"},
     "the pooling runner reads the final hidden states"),
])
def test_refusals_name_the_flag(tiny_llama_dir, kw, message):
    with pytest.raises(ConfigError, match=message):
        EngineArgs(model=str(tiny_llama_dir), **kw).create_kiln_config()


@pytest.mark.parametrize("family, architecture", [
    ("gemma", "GemmaForCausalLM"),  # (1 + w) norms: a folded weight is not 1 after
    ("olmo2", "Olmo2ForCausalLM"),  # norms after the blocks, before the residual add
    ("gemma2", "Gemma2ForCausalLM"),  # norms before and after each block
    ("phi", "PhiForCausalLM"),  # LayerNorm: its mean is not rotation invariant
    ("exaone4", "Exaone4ForCausalLM"),  # OLMo-2's post-block norms
    ("glm4", "Glm4ForCausalLM"),  # Gemma-2's sandwich norms
    # Llama's stream with experts: rotate_llama knows no MoE block
    ("mixtral", "MixtralForCausalLM"),
    ("qwen2_moe", "Qwen2MoeForCausalLM"),
    ("qwen3_moe", "Qwen3MoeForCausalLM"),
])
def test_other_families_run_int8_unrotated(request, family, architecture):
    """rotate_llama folds each norm's weight into the linears after it: wrong where the norms
    differ from Llama's, or where it knows no block reading the stream, so auto runs their int8
    unrotated and hadamard is refused."""
    model = str(request.getfixturevalue(f"tiny_{family}_dir"))
    config = EngineArgs(model=model, quantization="int8").create_kiln_config()
    assert config.model_config.quantization_rotation == "none"
    with pytest.raises(ConfigError, match=f"--quantization-rotation hadamard: {architecture} "
                                          "is not supported"):
        EngineArgs(model=model, quantization="int8",
                   quantization_rotation="hadamard").create_kiln_config()


def test_rotation_is_part_of_the_compile_cache_key(tiny_llama_dir):
    """A graph compiled without the rotation's two products must not be served with it; the
    key holds the resolved rotation, so auto and the hadamard it resolves to share graphs."""
    def key(**kw):
        return EngineArgs(model=str(tiny_llama_dir), quantization="int8",
                          **kw).create_kiln_config().compute_hash()
    assert key(quantization_rotation="none") != key(quantization_rotation="hadamard")
    assert key() == key(quantization_rotation="hadamard")
