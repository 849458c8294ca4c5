"""Speculative decoding at tensor parallel 2: n-gram drafts every rank verifies alike (same
logits, same generators), so greedy output is HF's and seeded sampling is TP=1's; an EAGLE-3
head sharded over the ranks drafts as at TP=1; a draft model sharded as the target drafts what
the target picks."""
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
    print("RUNS", runs[0][1:], runs[1][1:])
    assert runs[0] == runs[1]


def test_tp2_eagle3_head_drafts_and_outputs_as_tp1(tiny_llama_dir, tmp_path, ranks_exit):
    """An EAGLE-3 head sharded as the target's layers (qkv / gate_up column-, o / down
    row-parallel, fc replicated, its LM head over the draft vocabulary split by rows): the same
    drafts at every step and the same greedy output as at tp=1, which is HF's."""
    from spec_decode.eagle3_heads import write_eagle3_head

    head = write_eagle3_head(tmp_path / "head", tiny_llama_dir, draft_vocab=200)
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3}
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    runs = []
    for tp in (2, 1):
        llm = make_llm(tiny_llama_dir, tensor_parallel_size=tp, speculative_config=spec)
        scheduler, drafts = llm.llm_engine.engine_core.core.scheduler, []
        update = scheduler.update_from_output

        def recording(so, out, update=update, drafts=drafts):
            drafts.append(list(out.spec_token_ids.values()))  # rank 0's, in batch order
            return update(so, out)
        scheduler.update_from_output = recording
        outs = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, greedy,
                                                                    use_tqdm=False)]
        runs.append((outs, drafts))
        if tp == 2:
            ranks_exit(llm)
    assert sum(len(d) for step in runs[0][1] for d in step) >= 2 * 4 * 3
    assert runs[0] == runs[1]
    assert runs[0][0] == hf_greedy(tiny_llama_dir, PROMPTS, 16)


def test_tp2_draft_model_sharded_as_the_target_has_every_draft_accepted(tiny_llama_dir,
                                                                       ranks_exit):
    """A draft model (here the target's own checkpoint) sharded over the target's 2 ranks as
    the target is: each rank's draft shard proposes what the target picks, so every draft is
    accepted, and the greedy output is the one without speculation (HF's)."""
    spec = {"method": "draft_model", "model": str(tiny_llama_dir), "num_speculative_tokens": 3}
    llm = make_llm(tiny_llama_dir, tensor_parallel_size=2, speculative_config=spec)
    greedy = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], greedy, use_tqdm=False)
    stats = llm.llm_engine.get_stats()
    ranks_exit(llm)
    assert [list(o.outputs[0].token_ids) for o in outs] == hf_greedy(tiny_llama_dir, PROMPTS, 16)
    drafted = stats["spec_decode_num_draft_tokens"]
    assert drafted >= 2 * 3 * 3 and stats["spec_decode_num_accepted_tokens"] == drafted
