"""The C++ CPU kernel of kiln::unified_attention (kiln/native/csrc/unified_attention_op.cpp): a
step is handed to it before its first layer (or at it, unplanned), and its layers then never
reach Python, unless SDPA takes some of its queries (long ones the prefill kernel has no SIMD
tiles for)."""
import pytest
import torch

from kiln.attention.backend import kv_cache_shape
from kiln.attention.cpu_backend import CpuAttentionBackend, CpuAttentionImpl
from kiln.attention.torch_backend import TorchAttentionImpl
from kiln.config import CompilationConfig, set_current_kiln_config
from kiln.forward_context import set_forward_context
from kiln.model.layers.attention import Attention, attention_layers
from kiln.native import attention_op
from model._attn_helper import BlockPool, PagedRequest, build_step

NH, NKV, HD, BS, NUM_BLOCKS = 4, 2, 16, 4, 64

pytestmark = pytest.mark.skipif(not attention_op.available(),
                                reason="no C/C++ compiler: the C++ attention op cannot be built")


class _Config:
    def __init__(self):
        from kiln.platforms import CpuPlatform

        self.compilation_config = CompilationConfig()
        self.platform = CpuPlatform()


class Engine:
    """Attention layers as a model builds them, their caches, and a torch-backend reference
    run over copies of the same caches."""

    def __init__(self, num_layers: int = 3, dtype=torch.float32, seed: int = 0,
                 head_size: int = HD):
        self.cfg, self.dtype, self.hd = _Config(), dtype, head_size
        hd = head_size
        with set_current_kiln_config(self.cfg):
            self.layers = [Attention(NH, hd, hd ** -0.5, NKV, prefix=f"model.layers.{i}.attn")
                           for i in range(num_layers)]
        assert all(isinstance(layer.impl, CpuAttentionImpl) for layer in self.layers)
        self.table = attention_layers(torch.nn.ModuleList(self.layers))
        for layer in self.layers:
            layer.kv_cache = torch.zeros(kv_cache_shape(NUM_BLOCKS, BS, NKV, hd), dtype=dtype)
        self.reference = [torch.zeros_like(layer.kv_cache) for layer in self.layers]
        self.torch_impl = TorchAttentionImpl(NH, hd, hd ** -0.5, NKV)
        self.pool, self.g = BlockPool(NUM_BLOCKS, BS), torch.Generator().manual_seed(seed)
        self.reqs = [PagedRequest(list(range(40))) for _ in range(2)]

    def step(self, q_lens: list[int], num_padding: int = 0,
             begin_step: bool = False) -> tuple[dict, list, list]:
        """One forward of every layer; (call counts of the step, outputs, reference outputs).
        begin_step: the backend plans the step first, as the model runner has it do."""
        _, _, md = build_step(self.pool, self.reqs, q_lens, num_padding=num_padding)
        tokens = sum(q_lens) + num_padding
        before = attention_op.call_counts()
        outs, wants = [], []
        with set_forward_context(md, self.cfg, layers=self.table):
            if begin_step:
                CpuAttentionBackend.begin_step(md, BS)
            for layer, ref_cache in zip(self.layers, self.reference):
                q, k, v = (torch.randn(tokens, h * self.hd, generator=self.g).to(self.dtype)
                           for h in (NH, NKV, NKV))
                outs.append(layer(q, k, v))
                want = torch.empty_like(q)
                self.torch_impl.forward(q, k, v, ref_cache, md, want)
                wants.append(want)
        after = attention_op.call_counts()
        return {kind: after[kind] - before[kind] for kind in after}, outs, wants


def assert_same(outs, wants):
    for out, want in zip(outs, wants):
        torch.testing.assert_close(out.float(), want.float(), rtol=1e-5, atol=1e-5)


def test_decode_steps_take_the_cpp_kernel_after_their_first_layer():
    engine = Engine(num_layers=3)
    counts, outs, wants = engine.step([8, 5])  # prefill chunks of up to 8 tokens: short queries,
    assert_same(outs, wants)  # so this step is handed over too
    assert counts == {"kernel": 2, "python": 1}
    for _ in range(3):
        counts, outs, wants = engine.step([1, 1])
        assert_same(outs, wants)
        assert counts == {"kernel": 2, "python": 1}


def test_a_step_planned_before_its_layers_takes_the_cpp_kernel_in_all():
    engine = Engine(num_layers=3)
    for q_lens in ([8, 5], [1, 1], [1, 1]):
        counts, outs, wants = engine.step(q_lens, begin_step=True)
        assert_same(outs, wants)
        assert counts == {"kernel": 3, "python": 0}
    counts, outs, wants = engine.step([20, 1], begin_step=True)  # a long query: prefill kernel
    assert_same(outs, wants)
    assert counts == {"kernel": 3, "python": 0}


def test_the_model_runner_plans_each_step_before_its_layers(tiny_llama_dir, monkeypatch):
    from kiln.entrypoints.llm import LLM
    from kiln.sampling_params import SamplingParams

    monkeypatch.setenv("KILN_ENABLE_V1_MULTIPROCESSING", "0")  # the kernel counts are ours
    llm = LLM(model=str(tiny_llama_dir), enforce_eager=True, max_model_len=64,
              kv_cache_memory=0.01)
    before = attention_op.call_counts()
    llm.generate([{"prompt_token_ids": [1, 2, 3, 4]}, {"prompt_token_ids": [5, 6]}],
                 SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
    after = attention_op.call_counts()
    llm.shutdown()
    assert after["python"] == before["python"]  # every step's queries are short
    assert after["kernel"] - before["kernel"] == 2 * 4  # 2 layers, 4 steps


# A head size the prefill kernel's SIMD tiles do not serve (they step by 8 dims): its long
# queries go to SDPA.
SDPA_HEAD_SIZE = 12


def test_a_step_with_queries_for_sdpa_stays_in_python():
    from kiln.native import prefill_attention

    assert not prefill_attention.simd(torch.float32, SDPA_HEAD_SIZE)
    for begin_step in (False, True):
        engine = Engine(num_layers=3, head_size=SDPA_HEAD_SIZE)
        counts, outs, wants = engine.step([20, 3], begin_step=begin_step)
        assert_same(outs, wants)
        assert counts == {"kernel": 0, "python": 3}
        counts, outs, wants = engine.step([1, 1], begin_step=begin_step)  # short: C++ again
        assert_same(outs, wants)
        assert counts == ({"kernel": 3, "python": 0} if begin_step
                          else {"kernel": 2, "python": 1})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q_lens", [[20, 3], [33, 17], [0, 12]])
def test_a_step_with_long_queries_takes_the_cpp_kernel_with_the_same_outputs(
        q_lens, dtype, monkeypatch):
    """Prefill steps (and mixed ones) reach the prefill kernel from C++ after their first layer,
    bit for bit as the Python path (the same kernels with the same arguments) runs them."""
    from kiln.attention import cpu_backend

    engine, python = Engine(num_layers=3, dtype=dtype), Engine(num_layers=3, dtype=dtype)
    counts, outs, wants = engine.step(q_lens)
    assert counts == {"kernel": 2, "python": 1}
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for out, want in zip(outs, wants):
        torch.testing.assert_close(out.float(), want.float(), rtol=tol, atol=tol)
    monkeypatch.setattr(cpu_backend, "_hand_over", lambda *args: None)
    counts, reference, _ = python.step(q_lens)
    assert counts == {"kernel": 0, "python": 3}
    for out, ref in zip(outs, reference):
        assert torch.equal(out, ref)
    for a, b in zip(engine.layers, python.layers):
        assert torch.equal(a.kv_cache, b.kv_cache)


def test_padding_rows_are_zeroed_by_the_cpp_kernel():
    engine = Engine(num_layers=2)
    engine.step([4, 4])
    counts, outs, wants = engine.step([1, 1], num_padding=3)
    assert counts == {"kernel": 1, "python": 1}
    for out, want in zip(outs, wants):
        assert torch.equal(out[2:], torch.zeros_like(out[2:]))
        torch.testing.assert_close(out[:2], want[:2], rtol=1e-5, atol=1e-5)


def test_bfloat16_steps_match_the_torch_backend():
    engine = Engine(num_layers=2, dtype=torch.bfloat16)
    engine.step([6, 2])
    counts, outs, wants = engine.step([1, 1])
    assert counts == {"kernel": 1, "python": 1}
    for out, want in zip(outs, wants):
        torch.testing.assert_close(out.float(), want.float(), rtol=2e-2, atol=2e-2)


def test_a_reassigned_cache_is_used_and_the_old_one_left_alone():
    engine = Engine(num_layers=2)
    engine.step([5, 5])
    old = engine.layers[1].kv_cache
    engine.layers[1].kv_cache = old.clone()  # the old tensor stays alive: it must not be written
    snapshot = old.clone()
    counts, outs, wants = engine.step([1, 1])
    assert counts == {"kernel": 1, "python": 1}
    assert_same(outs, wants)
    assert torch.equal(old, snapshot)
    assert not torch.equal(engine.layers[1].kv_cache, snapshot)  # this step's k/v went there


def test_a_cache_whose_storage_moved_goes_back_to_python():
    engine = Engine(num_layers=2)
    engine.step([5, 5])
    cache = engine.layers[1].kv_cache
    cache.data = cache.clone()  # same tensor object, new storage: the table's address is stale
    counts, outs, wants = engine.step([1, 1])
    assert counts == {"kernel": 0, "python": 2}
    assert_same(outs, wants)


def test_engines_with_the_same_layer_names_keep_their_own_caches():
    a, b = Engine(num_layers=2, seed=1), Engine(num_layers=2, seed=2)
    for q_lens in ([4, 6], [1, 1], [1, 1]):
        for engine in (a, b):
            counts, outs, wants = engine.step(q_lens)
            assert counts == {"kernel": 1, "python": 1}
            assert_same(outs, wants)


def test_the_step_ends_with_its_forward_context():
    engine = Engine(num_layers=2)
    engine.step([3, 3])
    q, k, v = (torch.randn(2, h * HD) for h in (NH, NKV, NKV))
    with pytest.raises(RuntimeError, match="outside a forward context"):
        engine.layers[1](q, k, v)


def test_the_cpp_kernel_names_what_is_wrong():
    engine = Engine(num_layers=2)
    _, _, md = build_step(engine.pool, engine.reqs, [1, 1])
    good = [torch.randn(2, h * HD) for h in (NH, NKV, NKV)]
    with set_forward_context(md, engine.cfg, layers=engine.table):
        engine.layers[0](*good)  # the Python path hands the step over
        with pytest.raises(ValueError, match="k must be Float"):
            engine.layers[1](good[0], torch.randn(2, NKV * HD + 1), good[2])
        md_slots = md.slot_mapping.clone()
        md.slot_mapping[0] = NUM_BLOCKS * BS  # one past the cache, read through the plan
        with pytest.raises(IndexError, match=r"slot is outside \[-1, 256\)"):
            engine.layers[1](*good)
        md.slot_mapping.copy_(md_slots)


def test_each_kv_cache_group_gets_its_own_table_and_slots():
    """group_steps (pure): group 0's step for every group, with each group's block table and
    slot mapping over the same requests; one group: the step alone."""
    from types import SimpleNamespace

    from kiln.attention.cpu_backend import group_steps
    from kiln.native.paged_attention import StepArgs

    qsl, seq_lens, reqs = (torch.tensor(x, dtype=torch.int32) for x in ([0, 1, 2], [5, 9], [0, 1]))
    tables = [torch.full((2, 3), g, dtype=torch.int32) for g in range(3)]
    slots = [torch.full((2,), g, dtype=torch.int64) for g in range(3)]
    step = StepArgs(tables[0], qsl, seq_lens, reqs, 9, BS, slots[0], 2)
    groups = [SimpleNamespace(block_table=t, slot_mapping=s) for t, s in zip(tables, slots)]
    steps = group_steps(SimpleNamespace(group_metadata=groups), step)
    assert steps[0] is step and len(steps) == 3
    for g, s in enumerate(steps):
        assert s.block_table is tables[g] and s.slot_mapping is slots[g]
        assert (s.query_start_loc, s.seq_lens, s.reqs) == (qsl, seq_lens, reqs)
        assert (s.num_tokens, s.max_seq_len, s.block_size) == (2, 9, BS)
    assert group_steps(SimpleNamespace(group_metadata=None), step) == [step]


def test_a_prefill_request_outside_the_step_is_refused_at_hand_over():
    engine = Engine(num_layers=1)
    _, _, md = build_step(engine.pool, engine.reqs, [20, 1])
    step = CpuAttentionImpl._plan(md, BS).short
    table = attention_op.LayerTable({"x": attention_op.LayerEntry(engine.layers[0].kv_cache, 0,
                                                                   1.0, None, None)})
    with pytest.raises(IndexError, match="attention_begin_step: request 2 is outside the "
                                         "step's 2 requests"):
        attention_op.begin_step(table, [step], 21, torch.tensor([0, 2], dtype=torch.int32))
    attention_op.end_step()
