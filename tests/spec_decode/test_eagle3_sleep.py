"""An EAGLE-3 head under sleep mode and the RL weight hooks: a level-2 sleep discards its fc, norm,
LM head and d2t with the target's weights, and reload_weights brings back the same drafts; an
update aimed at it (load_weights(model="draft")) changes what it drafts, its d2t included."""
from collections import Counter

import pytest
import torch
from safetensors.torch import load_file

from kiln import SamplingParams
from kiln.errors import ConfigError

from .eagle3_heads import write_eagle3_head
from .test_eagle import record_proposals
from .test_spec_decode_e2e import PROMPTS, generate, make, spec_totals

K = 3
DRAFT_VOCAB = 16


def _run(llm, seen: list) -> tuple:
    """(greedy tokens, (accepted, drafted), each proposal) of one pass over PROMPTS."""
    seen.clear()
    before = spec_totals(llm)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    tokens = [list(o.token_ids) for o in generate(llm, PROMPTS, params)]
    after = spec_totals(llm)
    counts = tuple(after[f"spec_decode_num_{k}_tokens"] - before[f"spec_decode_num_{k}_tokens"]
                   for k in ("accepted", "draft"))
    return tokens, counts, list(seen)


def test_an_eagle3_head_sleeps_reloads_and_updates(inprocess_core, tiny_llama_dir, tmp_path):
    head = write_eagle3_head(tmp_path / "head", tiny_llama_dir, draft_vocab=DRAFT_VOCAB)
    llm = make(tiny_llama_dir, {"method": "eagle3", "model": str(head),
                                "num_speculative_tokens": K},
               enable_sleep_mode=True, max_model_len=64, kv_cache_memory=0.01)
    seen = record_proposals(llm)
    model = llm.llm_engine.engine_core.executor.worker.model_runner.drafter.model
    parts = (model.model.fc.weight, model.model.norm.weight, model.lm_head.weight, model.d2t,
             model.model.layers[0].hidden_norm.weight)
    tokens, (accepted, drafted), proposals = want = _run(llm, seen)
    assert drafted > 0 and proposals
    for level in (1, 2):
        llm.sleep(level=level)
        assert all((p.untyped_storage().nbytes() == 0) == (level == 2) for p in parts)
        llm.wake_up()
        if level == 2:
            llm.collective_rpc("reload_weights")
        assert _run(llm, seen) == want
    # an LM head of zeros ties every draft id: the first maximum is the lowest target id d2t
    # maps to, the target's most frequent greedy token here, so most drafts are accepted
    common = Counter(t for seq in tokens for t in seq if t < 512 - DRAFT_VOCAB).most_common(1)
    top = common[0][0]
    ids = torch.arange(top, top + DRAFT_VOCAB)
    update = {"lm_head.weight": torch.zeros_like(model.lm_head.weight),
              "d2t": ids - torch.arange(DRAFT_VOCAB)}
    llm.collective_rpc("load_weights", kwargs={"weights": list(update.items()),
                                               "model": "draft"})
    new_tokens, (new_accepted, _), new_proposals = _run(llm, seen)
    assert new_tokens == tokens
    assert {d for _, drafts in new_proposals for d in drafts} == {top}
    assert new_accepted > accepted
    # reload_weights reads the head's checkpoint again: its own drafts back
    llm.collective_rpc("reload_weights", kwargs={"model": "draft"})
    assert _run(llm, seen) == want
    # a d2t that maps two draft ids onto one target id is refused before it is written
    bad = ids - torch.arange(DRAFT_VOCAB)
    bad[1] = bad[0] - 1
    with pytest.raises(ConfigError, match=r"1 draft id\(s\) onto a target id another"):
        llm.collective_rpc("load_weights", kwargs={"weights": [("d2t", bad)], "model": "draft"})
    assert _run(llm, seen) == want
    # the whole checkpoint as a trainer sends it (t2d too, which the head does not use)
    weights = load_file(str(head / "model.safetensors"))
    assert "t2d" in weights
    llm.collective_rpc("load_weights", kwargs={"weights": list(update.items()),
                                               "model": "draft"})
    llm.collective_rpc("load_weights", kwargs={"weights": list(weights.items()),
                                               "model": "draft"})
    assert _run(llm, seen) == want
    llm.shutdown()
