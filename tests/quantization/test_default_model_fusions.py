"""On the default model (SmolLM2-135M, 30 layers) quantized on load, in mode 3, its residual
stream rotated as shipped and unrotated (vLLM's arithmetic): fuse_norm_quant matches twice a layer
(input and post-attention norms), fuse_act_quant once, fuse_mm_act_quant once where weights are
packed at load, and greedy tokens equal mode 0's. Kiln compiles three distinct pieces (the first,
one middle piece that the 28 other identical ones reuse, the last), so the passes run three
times: per layer is first + (layers - 1) x middle + last.
"""
import pytest

from kiln import LLM, SamplingParams
from kiln.benchmarks.engine_probe import engine_model
from kiln.native import int8_ops

# 31 cold piece compiles (tests/quantization/test_w8a8_generation.py checks the same counts on a
# 2-layer model); the engine core in this process, whose model the test reads
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("inprocess_core")]


def _llm(tmp_path, mode, rotation):
    cc = {"mode": mode, "cache_dir": str(tmp_path / "cc")}
    return LLM(dtype="bfloat16", quantization="int8", quantization_rotation=rotation,
               max_num_seqs=4, kv_cache_memory=0.2, compilation_config=cc)


@pytest.mark.parametrize("rotation, resolved", [("auto", "hadamard"), ("none", "none")])
def test_each_fusion_matches_once_per_norm_and_activation(tmp_path, rotation, resolved):
    llm = _llm(tmp_path, 3, rotation)
    assert llm.llm_engine.kiln_config.model_config.quantization_rotation == resolved
    layers = llm.llm_engine.kiln_config.model_config.num_layers
    runs = engine_model(llm.llm_engine).model._kiln_compile.backend.pass_manager.runs
    first, middle, last = [r["matches"] for r in runs if r["shape"] is None]  # compile order
    mm = 1 if int8_ops.packs_weights(576, "cpu") else 0
    # one decoder layer's
    assert (middle["FuseNormQuant"], middle["FuseActQuant"], middle["FuseMmActQuant"]) == (2, 1, mm)
    for name, per_layer in (("FuseNormQuant", 2), ("FuseActQuant", 1), ("FuseMmActQuant", mm)):
        assert first[name] + (layers - 1) * middle[name] + last[name] == per_layer * layers
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    compiled = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    llm.llm_engine.shutdown()
    eager = [o.outputs[0].token_ids
             for o in _llm(tmp_path, 0, rotation).generate(prompts, params, use_tqdm=False)]
    assert compiled == eager
