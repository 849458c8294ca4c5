"""W4A16 at 2 tensor-parallel ranks (mp executor): a column-parallel layer loads its output rows of
the packed weights, scales and zero points (GPTQ's zero points packed along N, unpacked first), a
row-parallel one its input groups (per channel: every rank keeps the whole rows' scales); greedy
tokens equal HF transformers' on the dequantized weights. A group that would straddle two ranks
is refused naming group_size and tensor_parallel_size.
"""
import pytest
import torch
from int4_checkpoint import write_int4_checkpoint

from kiln import SamplingParams
from kiln.errors import ConfigError
from kiln.model.layers.linear import ColumnParallelLinear, RowParallelLinear
from kiln.model.layers.quantization.int4_weight import Int4WeightConfig

from checkpoints import make_tiny_checkpoint, random_prompts
from parallel_helpers import make_llm

LENGTHS = [3, 17, 40]
NEW_TOKENS = 6


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("float"), "llama", tie=False)


def _hf_tokens(oracle, prompts):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(oracle, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    with torch.no_grad():
        return [model.generate(torch.tensor([p]), max_new_tokens=NEW_TOKENS, do_sample=False,
                               pad_token_id=0)[0, len(p):].tolist() for p in prompts]


def test_a_gptq_checkpoint_at_tp2_generates_hf_tokens(src, tmp_path):
    """GPTQ per channel with zero points: q/k/v and gate/up zero points packed along N are cut
    at the full rows, then each rank takes its rows; a row-parallel rank's half of each row
    keeps the row's scale and zero point. (One engine: groups split into whole groups a rank
    load as any row-parallel tensor does; the refusal is checked below.)"""
    q, oracle = write_int4_checkpoint(src, tmp_path / "q", tmp_path / "o", "gptq", -1, False)
    prompts = random_prompts(len(LENGTHS), LENGTHS, seed=11)
    llm = make_llm(q, tensor_parallel_size=2, kv_cache_memory=0.02, max_num_seqs=4)
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True),
                            use_tqdm=False)
    finally:
        llm.shutdown()
    assert [list(o.outputs[0].token_ids) for o in outs] == _hf_tokens(oracle, prompts)


def test_groups_straddling_two_ranks_are_refused_and_per_channel_splits():
    row = RowParallelLinear(64, 64, bias=False, tp_rank=1, tp_size=2)  # 32 inputs a rank
    with pytest.raises(ConfigError, match=r"tensor_parallel_size 2.*group_size=64.*straddle"):
        Int4WeightConfig("gptq", 64, False)._group("o_proj", row)
    assert Int4WeightConfig("gptq", 32, False)._group("o_proj", row) == 32
    assert Int4WeightConfig("gptq", -1, False)._group("o_proj", row) == 32  # per channel
    column = ColumnParallelLinear(64, 64, bias=False, tp_rank=1, tp_size=2)  # all 64 inputs
    assert Int4WeightConfig("awq", 64, False)._group("gate_proj", column) == 64
