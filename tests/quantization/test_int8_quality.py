"""Quality of W8A8 int8 on the default model (SmolLM2-135M, GGUF, quantized on load) against the
same model in bfloat16: top-1 agreement over 32 prompts x 64 greedy steps, teacher-forced on the
bfloat16 tokens, and perplexity on a fixed text shipped in tests/fixtures/quality/.

Measured on a 2-core AMD EPYC (AVX512-VNNI, no AMX): agreement 0.919 (1883 of 2048 steps),
perplexity 17.99 (int8) vs 17.47 (bfloat16), ratio 1.0297. On a 2-core Xeon with AMX the ratio
depends on which of the prefill attention kernel's three paths runs, although all three are
equally close to a float64 softmax (the same max and mean error): 18.01 / 17.41 = 1.034 with the
AVX512-BF16 tiles, 18.11 / 17.37 = 1.043 with the scalar loop, 18.10 / 17.37 = 1.042 with the
AMX tiles (agreement 0.918-0.925; an earlier exp polynomial in the tiles gave 1.029 and 1.047).
The int8 model amplifies last-bit differences in attention that the bfloat16 one does not (its
perplexity moves 0.2%). Asserted: agreement >= 0.90 and a ratio
<= 1.06, the largest measured plus a margin of that spread.
"""
import math
from pathlib import Path

import pytest

from kiln import LLM, SamplingParams

TEXT = Path(__file__).resolve().parent.parent / "fixtures" / "quality" / "text.txt"
NUM_PROMPTS, STEPS = 32, 64
MIN_AGREEMENT, MAX_PPL_RATIO = 0.90, 1.06

pytestmark = pytest.mark.slow  # ~5 min on 2 busy cores; the tiny-model tests cover the same path


def _llm(**kw):
    return LLM(dtype="bfloat16", enforce_eager=True, max_num_seqs=NUM_PROMPTS,
               kv_cache_memory=0.5, **kw)


def _prompts(tokenizer) -> list[list[int]]:
    lines = TEXT.read_text().splitlines()[:NUM_PROMPTS]
    return [tokenizer.encode(" ".join(line.split()[:6])) for line in lines]


def _top1(llm, sequences: list[list[int]]) -> list[list[int | None]]:
    """Each position's most likely next token given the sequence before it (teacher forcing)."""
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    outs = llm.generate([{"prompt_token_ids": s} for s in sequences], params, use_tqdm=False)
    return [[None] + [next(t for t, lp in entry.items() if lp.rank == 1)
                      for entry in o.prompt_logprobs[1:]] for o in outs]


def _perplexity(llm, ids: list[int]) -> float:
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)
    out = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
    lps = [entry[tok].logprob for tok, entry in zip(ids[1:], out.prompt_logprobs[1:])]
    return math.exp(-sum(lps) / len(lps))


@pytest.fixture(scope="module")
def measured():
    ref = _llm()
    tok = ref.get_tokenizer()
    prompts = _prompts(tok)
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True)
    outs = ref.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    sequences = [p + list(o.outputs[0].token_ids) for p, o in zip(prompts, outs)]
    text_ids = tok.encode(TEXT.read_text())
    ref_ppl = _perplexity(ref, text_ids)
    ref.llm_engine.shutdown()
    int8 = _llm(quantization="int8")
    top1 = _top1(int8, sequences)
    hits = sum(top1[i][j] == sequences[i][j]
               for i, p in enumerate(prompts) for j in range(len(p), len(sequences[i])))
    figures = {"agreement": hits / (NUM_PROMPTS * STEPS), "ppl_bf16": ref_ppl,
               "ppl_int8": _perplexity(int8, text_ids)}
    print(figures)
    return figures


def test_top1_agreement_with_bfloat16(measured):
    assert measured["agreement"] >= MIN_AGREEMENT, measured


def test_perplexity_within_bound_of_bfloat16(measured):
    assert measured["ppl_int8"] / measured["ppl_bf16"] <= MAX_PPL_RATIO, measured
