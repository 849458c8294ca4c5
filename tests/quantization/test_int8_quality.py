"""Quality of W8A8 int8 on the default model (SmolLM2-135M, GGUF, quantized on load) against the
same model in bfloat16: top-1 agreement over 32 prompts x 64 greedy steps, teacher-forced on the
bfloat16 tokens, and perplexity on a fixed text shipped in tests/fixtures/quality/. The engine as
shipped (`LLM(quantization="int8")`: its residual stream rotated, --quantization-rotation auto)
is held to issue 23's bound and tighter; vLLM's unrotated arithmetic (`quantization_rotation=
"none"`) to the looser one measured for it below.

A step agrees where the bfloat16 token has the int8 model's best logprob, ties included: ranks
count a tie against the token (vLLM's, since 215cf370), and bfloat16 logits tie often enough
that reading rank == 1 scored 0.8975 at 02c03ed5 (0.901 on 8251944e's tokens, 33 ties fewer).

Measured on a 2-core AMD EPYC (Zen 4: AVX512-VNNI and AVX512-BF16, no AMX) at 02c03ed5
(2026-12-07): agreement 0.911 (1866 of 2048 steps), perplexity 18.005 (int8) vs 17.413
(bfloat16), ratio 1.034. At 8251944e the same machine gave 0.917 (1879) and the same
perplexities (not the 0.919 and 17.99 / 17.47 once written here); the int8 model still scores
0.917 on that commit's bfloat16 tokens. What moved is the reference's greedy tokens: 17 of 32
continuations differ, 29 of 32 come back with decode attention's VDPBF16PS dot products
(f2b9c4c2) compiled out, and both sets are equally close to a float32 model (its argmax at 2007
vs 2003 of the 2048 steps, mean logprob shortfall 0.0011 both).

On a 2-core Xeon with AMX the ratio depends on which of the prefill attention kernel's three paths
runs, although all three are equally close to a float64 softmax (the same max and mean error):
18.01 / 17.41 = 1.034 with the AVX512-BF16 tiles, 18.11 / 17.37 = 1.043 with the scalar loop,
18.10 / 17.37 = 1.042 with the AMX tiles (agreement 0.918-0.925; an earlier exp polynomial in the
tiles gave 1.029 and 1.047). The int8 model amplifies last-bit differences in attention that
the bfloat16 one does not (its perplexity moves 0.2%). Asserted: agreement >= 0.90 and a ratio
<= 1.06, the largest measured plus a margin of that spread (now for quantization_rotation="none").

At d28fcc72 the same machine gives agreement 0.916-0.917 (two runs) and 18.170 / 17.428 =
1.043. The ratio is that noisy by nature: on this text (782 tokens) a fake-quantized float32
copy of the int8 model (same scales, same rounding) scores 1.033-1.047 over weight scales of
amax / 126.8 ... 127.5, equivalent roundings, while its mean KL divergence from the float model
stays at 0.021-0.023 nats. By that KL the loss is the activations' (0.021 with int8 activations
alone, 0.003 with int8 weights alone), spread over every layer (0.001-0.002 each) but the last,
whose gate_up input (one channel 50x its median) alone costs 0.005.

With the rotation (the residual stream rotated before quantizing, the default since; same machine,
2026-12-07, d28fcc72 plus the rotation) agreement 0.947 and ratio 17.660 / 17.428 = 1.013, and
over three seeds of the rotation's random factor 0.943-0.947 and 1.005-1.020 (without the per-head
v / o Hadamard 0.942-0.953 and 1.004-1.028). Asserted for the default engine: agreement >= 0.93
and a ratio <= 1.03 (issue 23 asks >= 0.90 and 3%), the largest measured plus that margin and
clear of the unrotated model's 0.911-0.925 / 1.034-1.043.
"""
import math
from pathlib import Path

import pytest

from kiln import LLM, SamplingParams
from kiln.outputs import Logprob

TEXT = Path(__file__).resolve().parent.parent / "fixtures" / "quality" / "text.txt"
NUM_PROMPTS, STEPS = 32, 64
# LLM(quantization="int8") as shipped: rotated (kiln/config/quantization_rotation.py)
MIN_AGREEMENT, MAX_PPL_RATIO = 0.93, 1.03
# quantization_rotation="none": vLLM's plain online int8
MIN_UNROTATED_AGREEMENT, MAX_UNROTATED_PPL_RATIO = 0.90, 1.06

# The model tests are slow (~5 min on 2 busy cores); the tiny-model tests cover the same path.


def _llm(**kw):
    return LLM(dtype="bfloat16", enforce_eager=True, max_num_seqs=NUM_PROMPTS,
               kv_cache_memory=0.5, **kw)


def _prompts(tokenizer) -> list[list[int]]:
    lines = TEXT.read_text().splitlines()[:NUM_PROMPTS]
    return [tokenizer.encode(" ".join(line.split()[:6])) for line in lines]


def _ranks_first(entry: dict[int, Logprob], token: int) -> bool:
    """Whether `token` has the entry's best logprob, ties included. Not `rank == 1`: ranks count
    a tie against the token (vLLM's), so a token tied for the top with a lower id ranks 2."""
    return entry[token].logprob >= max(lp.logprob for lp in entry.values())


def _agreement(llm, sequences: list[list[int]], starts: list[int]) -> float:
    """Share of positions from starts[i] on whose token the model ranks first given the
    sequence before it (teacher forcing)."""
    params = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1)
    outs = llm.generate([{"prompt_token_ids": s} for s in sequences], params, use_tqdm=False)
    hits = [_ranks_first(o.prompt_logprobs[j], s[j])
            for s, start, o in zip(sequences, starts, outs) for j in range(start, len(s))]
    return sum(hits) / len(hits)


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
    figures = {"rotation": int8.llm_engine.kiln_config.model_config.quantization_rotation,
               "agreement": _agreement(int8, sequences, [len(p) for p in prompts]),
               "ppl_bf16": ref_ppl,
               "ppl_int8": _perplexity(int8, text_ids)}
    int8.llm_engine.shutdown()
    unrotated = _llm(quantization="int8", quantization_rotation="none")
    figures.update(agreement_unrotated=_agreement(unrotated, sequences,
                                                  [len(p) for p in prompts]),
                   ppl_int8_unrotated=_perplexity(unrotated, text_ids))
    unrotated.llm_engine.shutdown()
    print(figures)
    return figures


def test_a_token_tied_for_the_top_ranks_first():
    tied = {30: Logprob(-2.2984, rank=2), 28: Logprob(-2.2984, rank=1)}  # 30 sampled, 28 top-1
    assert _ranks_first(tied, 30) and _ranks_first(tied, 28)
    below = {7: Logprob(-2.5, rank=3), 28: Logprob(-2.2984, rank=1)}
    assert not _ranks_first(below, 7)


@pytest.mark.slow
def test_top1_agreement_with_bfloat16(measured):
    assert measured["rotation"] == "hadamard", measured  # the default engine's
    assert measured["agreement"] >= MIN_AGREEMENT, measured


@pytest.mark.slow
def test_perplexity_within_bound_of_bfloat16(measured):
    assert measured["ppl_int8"] / measured["ppl_bf16"] <= MAX_PPL_RATIO, measured


@pytest.mark.slow
def test_unrotated_int8_within_its_bound(measured):
    assert measured["agreement_unrotated"] >= MIN_UNROTATED_AGREEMENT, measured
    ratio = measured["ppl_int8_unrotated"] / measured["ppl_bf16"]
    assert ratio <= MAX_UNROTATED_PPL_RATIO, measured
