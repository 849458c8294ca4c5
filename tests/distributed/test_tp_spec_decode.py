"""N-gram speculative decoding at tensor parallel 2: every rank verifies the drafts alike (same
logits, same generators), so greedy output is HF's and seeded sampling is TP=1's."""
from kiln import SamplingParams

from checkpoints import hf_greedy
from parallel_helpers import make_llm

SPEC = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
        "prompt_lookup_min": 1}
PROMPTS = [[5, 6, 7, 8, 9] * 6, list(range(10, 30)) * 2]


def test_tp2_spec_decode_greedy_is_hf_and_sampling_is_tp1(tiny_llama_dir, ranks_exit):
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    sampled = SamplingParams(temperature=0.3, max_tokens=16, ignore_eos=True, seed=7)
    runs = []
    for tp in (2, 1):
        llm = make_llm(tiny_llama_dir, tensor_parallel_size=tp, speculative_config=SPEC)
        runs.append([[list(o.outputs[0].token_ids) for o in llm.generate(prompts, p,
                                                                         use_tqdm=False)]
                     for p in (greedy, sampled)])
        assert llm.llm_engine.get_stats()["spec_decode_num_accepted_tokens"] > 0
        if tp == 2:
            ranks_exit(llm)
    assert runs[0][0] == hf_greedy(tiny_llama_dir, PROMPTS, 16)
    assert runs[0] == runs[1]
