"""CUDA graphs end to end on a GPU: greedy parity with HF in every graph mode, with batches that
pad (decode and mixed); every graph recorded once before serving, replayed, none recorded after.

float32: tokens must equal HF's exactly. bfloat16: graph mode vs no graphs in the same dtype,
tokens equal up to the first divergence (at least the first 3) and logprobs of agreeing tokens
within 0.05.
"""
import pytest
import torch

from kiln.compilation.counters import compilation_counter
from kiln.cudagraphs.dispatcher import resolve_cudagraph_mode
from kiln.cudagraphs.mode import CUDAGraphMode

# The core in this process: the tests read its model runner and compile counters.
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
              pytest.mark.usefixtures("inprocess_core")]

M = CUDAGraphMode
# max_num_seqs=4 -> capture sizes 1, 2, 4, 8. Six prompts finishing at different steps give
# decode batches of 4 and 3 (pads to 4), and mixed steps where a waiting prompt's prefill joins
# running decodes (e.g. 2 + 3 = 5 tokens, pads to 8); the first prefill (27 tokens) runs eager.
PROMPT_LENS = [4, 6, 3, 7, 2, 5]
MAX_TOKENS = [6, 9, 4, 8, 7, 5]


def _hf_greedy(model_dir, prompts, max_new_tokens):
    """HF's greedy continuation of each prompt, one at a time, in float32 on the GPU."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
    outs = []
    with torch.no_grad():
        for ids in prompts:
            y = model.generate(torch.tensor([ids], device="cuda"), do_sample=False,
                               max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                               pad_token_id=0)
            outs.append(y[0, len(ids):].tolist())
    return outs


def _make_llm(model_dir, mode, dtype="float32"):
    from kiln import LLM

    return LLM(model=str(model_dir), dtype=dtype, max_model_len=128, max_num_seqs=4,
               max_num_batched_tokens=64, num_gpu_blocks_override=256, seed=0,
               compilation_config={"cudagraph_mode": mode})


def _runner(llm):
    return llm.llm_engine.engine_core.executor.worker.model_runner


def _generate(llm, prompts, logprobs=None):
    from kiln import SamplingParams

    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=logprobs)
              for n in MAX_TOKENS]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0] for o in outs]


def _expected_mode(requested: str) -> CUDAGraphMode:
    from kiln.attention.backend import get_attn_backend

    mode, _ = resolve_cudagraph_mode(
        requested, platform_supports_cudagraph=True, enforce_eager=False, compilation_mode=3,
        has_splitting_ops=True, attn_supports_full=get_attn_backend().supports_full_cudagraph)
    return mode


@pytest.fixture(scope="module")
def prompts_and_oracle(tiny_llama_dir):
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 512, (n,), generator=g).tolist() for n in PROMPT_LENS]
    full = _hf_greedy(tiny_llama_dir, prompts, max(MAX_TOKENS))
    return prompts, [seq[:n] for seq, n in zip(full, MAX_TOKENS)]


@pytest.mark.parametrize("mode", ["PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"])
def test_greedy_parity_and_graph_counters(tiny_llama_dir, prompts_and_oracle, mode, monkeypatch):
    monkeypatch.setenv("KILN_CUDAGRAPH_DEBUG", "1")  # replays check input addresses
    prompts, expected = prompts_and_oracle
    before = compilation_counter.clone()
    llm = _make_llm(tiny_llama_dir, mode)
    try:
        resolved = _runner(llm).cudagraph_dispatcher.cudagraph_mode
        assert _runner(llm).compile_state.cudagraph_mode is resolved
        assert resolved is _expected_mode(mode)
        plan = _runner(llm).cudagraph_dispatcher.capture_plan()
        num_pieces = (compilation_counter.num_piecewise_capturable_graphs_seen
                      - before.num_piecewise_capturable_graphs_seen)
        piecewise_keys = sum(1 for m, _ in plan if m is M.PIECEWISE)
        full_keys = sum(1 for m, _ in plan if m is M.FULL)
        assert (compilation_counter.num_cudagraph_captured - before.num_cudagraph_captured
                == piecewise_keys * num_pieces + full_keys)

        serving = compilation_counter.clone()
        with compilation_counter.expect(num_cudagraph_captured=0):  # nothing recorded serving
            outs = _generate(llm, prompts)
        assert [o.token_ids for o in outs] == expected
        piece_replays = (compilation_counter.num_cudagraph_replays_piecewise
                         - serving.num_cudagraph_replays_piecewise)
        full_replays = (compilation_counter.num_cudagraph_replays_full
                        - serving.num_cudagraph_replays_full)
        assert (piece_replays > 0) == resolved.has_piecewise_cudagraphs()
        assert (full_replays > 0) == resolved.has_full_cudagraphs()
        if resolved.has_piecewise_cudagraphs():
            assert piece_replays % num_pieces == 0  # every piece replays in a PIECEWISE step
    finally:
        llm.llm_engine.shutdown()


def test_none_mode_records_nothing(tiny_llama_dir, prompts_and_oracle):
    prompts, expected = prompts_and_oracle
    with compilation_counter.expect(num_cudagraph_captured=0, num_cudagraph_replays_full=0,
                                    num_cudagraph_replays_piecewise=0):
        llm = _make_llm(tiny_llama_dir, "NONE")
        try:
            assert [o.token_ids for o in _generate(llm, prompts)] == expected
        finally:
            llm.llm_engine.shutdown()


def test_bfloat16_graphs_track_eager(tiny_llama_dir, prompts_and_oracle):
    prompts, _ = prompts_and_oracle
    results = {}
    for mode in ("NONE", "FULL_AND_PIECEWISE"):
        llm = _make_llm(tiny_llama_dir, mode, dtype="bfloat16")
        try:
            results[mode] = _generate(llm, prompts, logprobs=0)
        finally:
            llm.llm_engine.shutdown()
    for eager, graph in zip(results["NONE"], results["FULL_AND_PIECEWISE"]):
        agree = 0
        for a, b in zip(eager.token_ids, graph.token_ids):
            if a != b:
                break
            agree += 1
        assert agree >= min(3, len(eager.token_ids))
        for i in range(agree):
            tok = eager.token_ids[i]
            diff = abs(eager.logprobs[i][tok].logprob - graph.logprobs[i][tok].logprob)
            assert diff <= 0.05, (i, diff)
