"""Online int8's residual-stream rotation (`quantization_rotation` auto) on the engine paths beside
test_residual_rotation.py's plain Llama engine: a GGUF file, each rotatable family (Llama with
biases, Mistral with a sliding window, Qwen2, Qwen3's q/k norms, Granite's multipliers, ERNIE-4.5,
Seed-OSS, SmolLM3, Phi-3), data parallel replicas, prefix-cache hits, n-gram and draft-model
speculation. Forced onto a float model the transform is exact (logprobs within 2e-4, measured
1e-5); rotated int8 answers as the same engine does without the path (1e-4, measured 4e-6).
Where it cannot apply auto runs unrotated: LoRA (here), other norm layouts and the mixtures of
experts (test_residual_rotation.py).
"""
import os
from pathlib import Path

import pytest
import torch
from lora_adapters import merged_model, token_logprobs, write_adapter

from kiln import LLM, SamplingParams
from kiln.benchmarks.engine_probe import engine_model
from kiln.lora.request import LoRARequest
from kiln.model import residual_rotation as rr

from .test_residual_rotation import LENGTHS, NEW_TOKENS, _max_diff, _run
from checkpoints import (
    greedy_tokens_and_logprobs,
    make_tiny_checkpoint,
    random_prompts,
    with_random_norms_and_biases,
)

EXACT = 2e-4  # float32 rounding of a transform exact in real arithmetic
SAME_ENGINE = 1e-4  # one int8 engine's answers computed another way (measured 4e-6)
# int8 against HF's float logprobs of the same tokens (measured 0.06-0.17; the rotation with
# the o / down biases left unrotated: 1.9, the v biases: 1.5-1.8)
FROM_FLOAT = 0.3
_BIASES = {"attention_bias": True, "mlp_bias": True}
# rotatable architecture -> (tiny checkpoint kind, its fields): every one is checked here, with
# every bias the family can have
FAMILIES = {"LlamaForCausalLM": ("llama", _BIASES),
            "MistralForCausalLM": ("mistral_window", {}),
            "Qwen2ForCausalLM": ("qwen2", {}),  # q/k/v biases
            "Qwen3ForCausalLM": ("qwen3", {"attention_bias": True}),  # per-head q/k norms
            "GraniteForCausalLM": ("granite", _BIASES),  # four multipliers, none of them 1
            "Ernie4_5ForCausalLM": ("ernie4_5", {}),  # use_bias: every linear's
            "SeedOssForCausalLM": ("seed_oss", {"mlp_bias": True}),  # o_proj's own switch
            "SmolLM3ForCausalLM": ("smollm3", _BIASES),  # layer 1 NoPE
            "Phi3ForCausalLM": ("phi3", {})}  # fused qkv / gate_up, split on load


def force_rotation(monkeypatch) -> None:
    """Rotate what loads, float models too (the flag itself asks for int8): the transform alone,
    against the model unrotated (in-process engines only)."""
    apply = rr.apply_rotation
    monkeypatch.setattr(rr, "apply_rotation", lambda model, rotation: apply(model, "hadamard"))


def _llm(model_dir, **kw):
    kw.setdefault("max_num_batched_tokens", 64)
    return LLM(model=str(model_dir), dtype="float32", max_num_seqs=8, kv_cache_memory=0.05,
               compilation_config={"mode": 0}, **kw)


def _rotated(llm) -> bool:
    return engine_model(llm.llm_engine).model.residual_rotation is not None


@pytest.mark.usefixtures("inprocess_core")
@pytest.mark.parametrize("kind", ["F32", "Q8_0"])
def test_a_gguf_file_rotates_as_its_checkpoint(llama_dir, tmp_path, monkeypatch, kind):
    """The rotated weights replace the GGUF blocks the native GEMM reads (kept, the unrotated
    blocks ran on the rotated stream: other tokens); online int8 rotates an F32 file as it does
    the safetensors checkpoint it came from, to the bit."""
    from model.test_gguf_vs_hf import write_gguf

    monkeypatch.setenv("KILN_CACHE_ROOT", str(tmp_path / "cache"))
    # a snapshot is of unquantized loads only, never rotated by a real config: none here
    monkeypatch.setenv("KILN_WEIGHT_SNAPSHOT", "0")
    linears = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
    path = write_gguf(tmp_path / "m.gguf", llama_dir, types=dict.fromkeys(linears, kind))
    if kind == "F32":
        tokens, logprobs, rotated = _run(path, tmp_path, quantization="int8")
        want_tokens, want, checkpoint_rotated = _run(llama_dir, tmp_path, quantization="int8")
        assert rotated and checkpoint_rotated
        assert tokens == want_tokens and _max_diff(logprobs, want) < 1e-5  # measured 0
    tokens, logprobs, rotated = _run(path, tmp_path)
    assert not rotated
    force_rotation(monkeypatch)
    rot_tokens, rot_logprobs, rotated = _run(path, tmp_path)
    assert rotated and rot_tokens == tokens and _max_diff(rot_logprobs, logprobs) < EXACT


def test_every_rotatable_architecture_is_checked_here():
    assert set(FAMILIES) == set(rr.ROTATABLE_ARCHITECTURES)


@pytest.mark.usefixtures("inprocess_core")
@pytest.mark.parametrize("architecture", sorted(FAMILIES))
def test_each_rotatable_family_is_exact_and_int8_runs_rotated(architecture, tmp_path,
                                                              monkeypatch):
    """Norms folded (Qwen3's q/k norms left as drawn), biases moved (q/k/v, o, gate/up, down:
    drawn at random, not HF's zeros), Mistral's window, Granite's multipliers: the transform
    forced onto the float model is exact; int8 as shipped rotates and stays near HF's float
    logprobs of the tokens it chose."""
    from transformers import AutoModelForCausalLM

    kind, fields = FAMILIES[architecture]
    model_dir = with_random_norms_and_biases(make_tiny_checkpoint(
        tmp_path / "m", kind, tie=False, hidden_size=192, num_attention_heads=6, **fields))
    tokens, logprobs, rotated = _run(model_dir, tmp_path, quantization="int8")
    assert rotated
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    prompts = random_prompts(len(LENGTHS), LENGTHS, seed=5)  # _run's
    want = [token_logprobs(hf, p, t) for p, t in zip(prompts, tokens)]
    assert 0 < _max_diff(logprobs, want) < FROM_FLOAT
    float_tokens, float_logprobs, _ = _run(model_dir, tmp_path)
    force_rotation(monkeypatch)
    rot_tokens, rot_logprobs, rotated = _run(model_dir, tmp_path)
    assert rotated and rot_tokens == float_tokens
    assert _max_diff(rot_logprobs, float_logprobs) < EXACT


def mark_rotation(worker, where: str) -> None:
    """collective_rpc's function: leaves "<replica>-<rotated>" in `where` (only replica 0's
    answer comes back)."""
    rotated = worker.model_runner.model.model.residual_rotation is not None
    Path(where, f"{worker.kiln_config.parallel_config.data_parallel_rank}-{rotated}").touch()


def test_data_parallel_replicas_each_rotate(llama_dir, tmp_path, monkeypatch):
    """Each replica loads and rotates its own copy: DP 2 answers as one engine does."""
    # replicas run in core processes, whatever the module's in-process tests left set
    monkeypatch.delenv("KILN_ENABLE_V1_MULTIPROCESSING", raising=False)
    prompts = random_prompts(6, [5, 9, 40, 12, 90, 4], seed=3)
    dp = _llm(llama_dir, quantization="int8", data_parallel_size=2)
    try:
        marks = tmp_path / "marks"
        marks.mkdir()
        dp.collective_rpc(mark_rotation, args=(str(marks),))
        assert sorted(os.listdir(marks)) == ["0-True", "1-True"]
        tokens, logprobs = greedy_tokens_and_logprobs(dp, prompts, NEW_TOKENS)
        engines = dp.llm_engine.get_stats()["engines"]
        assert all(e["prefix_cache_queries"] > 0 for e in engines), engines  # both ran some
    finally:
        dp.llm_engine.shutdown()
    one = _llm(llama_dir, quantization="int8")
    try:
        want_tokens, want = greedy_tokens_and_logprobs(one, prompts, NEW_TOKENS)
    finally:
        one.llm_engine.shutdown()
    assert tokens == want_tokens and _max_diff(logprobs, want) < SAME_ENGINE


@pytest.mark.usefixtures("inprocess_core")
def test_prefix_cache_hits_answer_as_a_fresh_prefill(llama_dir):
    """Cached blocks hold the rotated engine's K and (per-head rotated) V: a hit reads them back
    as the prefill that wrote them, through 16-token chunks."""
    prefix = random_prompts(1, [48], seed=9)[0]
    prompts = [prefix + p for p in random_prompts(4, [3, 17, 1, 30], seed=11)]
    cached = _llm(llama_dir, quantization="int8", max_num_batched_tokens=16)
    fresh = _llm(llama_dir, quantization="int8", max_num_batched_tokens=16,
                 enable_prefix_caching=False)
    try:
        assert _rotated(cached) and _rotated(fresh)
        greedy_tokens_and_logprobs(cached, prompts[:1], NEW_TOKENS)
        hits = cached.llm_engine.get_stats()["prefix_cache_hits"]
        tokens, logprobs = greedy_tokens_and_logprobs(cached, prompts, NEW_TOKENS)
        assert cached.llm_engine.get_stats()["prefix_cache_hits"] - hits >= 3 * 48
        want_tokens, want = greedy_tokens_and_logprobs(fresh, prompts, NEW_TOKENS)
    finally:
        cached.llm_engine.shutdown()
        fresh.llm_engine.shutdown()
    assert tokens == want_tokens and _max_diff(logprobs, want) < SAME_ENGINE


@pytest.mark.usefixtures("inprocess_core")
@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_speculation_verifies_on_the_rotated_target(llama_dir, method):
    """The drafts (n-gram, or the float checkpoint itself: an unrotated draft, only its tokens
    cross) are verified by the rotated int8 target: its greedy answers, drafts accepted."""
    from spec_decode.test_spec_decode_e2e import PROMPTS, spec_totals

    spec = ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
             "prompt_lookup_min": 1} if method == "ngram" else
            {"method": "draft_model", "model": str(llama_dir), "num_speculative_tokens": 3})
    speculating = _llm(llama_dir, quantization="int8", speculative_config=spec)
    plain = _llm(llama_dir, quantization="int8")
    try:
        assert _rotated(speculating) and _rotated(plain)
        tokens, logprobs = greedy_tokens_and_logprobs(speculating, PROMPTS, 24)
        assert spec_totals(speculating)["spec_decode_num_accepted_tokens"] > 0
        want_tokens, want = greedy_tokens_and_logprobs(plain, PROMPTS, 24)
    finally:
        speculating.llm_engine.shutdown()
        plain.llm_engine.shutdown()
    assert tokens == want_tokens and _max_diff(logprobs, want) < SAME_ENGINE


@pytest.mark.usefixtures("inprocess_core")
def test_lora_runs_int8_unrotated(llama_dir, tmp_path):
    """An adapter is trained on the unrotated layers (A reads the stream, B writes into it):
    auto leaves an int8 engine with --enable-lora unrotated (an explicit hadamard is refused:
    test_residual_rotation.py), whose adapter answers stay near HF's on the merged weights."""
    from transformers import AutoModelForCausalLM

    adapter = write_adapter(tmp_path / "adapter", llama_dir)
    prompts = random_prompts(3, [5, 9, 40], seed=5)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    llm = _llm(llama_dir, quantization="int8", enable_lora=True, max_lora_rank=8)
    try:
        assert llm.llm_engine.kiln_config.model_config.quantization_rotation == "none"
        assert not _rotated(llm)
        outs = [o.outputs[0] for o in llm.generate(
            [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False,
            lora_request=LoRARequest("adapter", 1, str(adapter)))]
    finally:
        llm.llm_engine.shutdown()
    merged = merged_model(llama_dir, adapter)
    base = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32).eval()
    for prompt, out in zip(prompts, outs):
        got = [next(iter(step.values())).logprob for step in out.logprobs]
        tokens = list(out.token_ids)
        # unrotated int8 on a stream with a 20x channel: measured 0.25
        assert _max_diff([got], [token_logprobs(merged, prompt, tokens)]) < 0.5
        # the adapter applied: the base model's are 6.5-15 away
        assert _max_diff([got], [token_logprobs(base, prompt, tokens)]) > 2
