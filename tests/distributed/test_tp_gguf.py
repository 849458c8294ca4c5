"""A GGUF file at 2 tensor-parallel ranks and at 2 pipeline stages (mp executor): a tied Q8_0
embedding (the head reads token_embd) and a vocabulary of 511 rows, which does not divide by
2 (the last rank's rows are padding). TP ranks multiply by their dequantized slices where TP=1
multiplies by the file's blocks: greedy tokens equal TP=1's, prompt logprobs within 1e-4
(measured 2.4e-6 at tp2, 2.9e-6 at pp2)."""
import pytest
from model.test_gguf_vs_hf import write_gguf

from kiln import SamplingParams

from checkpoints import make_tiny_checkpoint, random_prompts
from parallel_helpers import make_llm

LENGTHS = [1, 9, 40, 90]  # 90 > the 64-token budget: chunked prefill
_Q8 = ("token_embd", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up")


@pytest.fixture(scope="module")
def tied_q8(tmp_path_factory):
    hf = make_tiny_checkpoint(tmp_path_factory.mktemp("hf"), "llama", tie=True,
                              intermediate_size=132, vocab_size=511)
    return write_gguf(tmp_path_factory.mktemp("gguf") / "tied.gguf", hf,
                      {p: "Q8_0" for p in _Q8}), hf


def _run(path, tok_dir, **kw):
    llm = make_llm(path, tokenizer=str(tok_dir), max_num_batched_tokens=64, **kw)
    prompts = [{"prompt_token_ids": p}
               for p in random_prompts(len(LENGTHS), LENGTHS, vocab=511, seed=5)]
    try:
        scored = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=1,
                                                      prompt_logprobs=0), use_tqdm=False)
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8,
                                                    ignore_eos=True), use_tqdm=False)
    finally:
        llm.shutdown()
    return ([[next(iter(s.values())).logprob for s in o.prompt_logprobs[1:]] for o in scored],
            [o.outputs[0].token_ids for o in outs])


@pytest.mark.parametrize("parallel", [{"tensor_parallel_size": 2},
                                      pytest.param({"pipeline_parallel_size": 2},
                                                   marks=pytest.mark.slow)])
def test_a_tied_q8_0_gguf_split_over_ranks_gives_tp1s_tokens(tied_q8, tmp_path, monkeypatch,
                                                             parallel):
    # A cache root of the test's own (the GGUF metadata cache); the ranks load this process's
    # CPU kernels from its cache root (build.INHERITED_LIBRARY_ENV), never building them again.
    monkeypatch.setenv("KILN_CACHE_ROOT", str(tmp_path / "cache"))
    path, hf = tied_q8
    want_lp, want = _run(path, hf)
    got_lp, got = _run(path, hf, **parallel)
    assert got == want
    assert max(abs(x - y) for a, b in zip(got_lp, want_lp) for x, y in zip(a, b)) < 1e-4
