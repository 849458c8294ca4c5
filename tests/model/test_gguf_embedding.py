"""The IR op gguf_embedding (kiln/ir/gguf.py): rows of a weight's GGUF blocks in Kiln's layout,
exactly gguf's dequantization rounded to the dtype, in the reference and in the native kernel
for every kept ggml type; and the tied embedding of a GGUF model reading its head's blocks, so
that the dense table is let go with the same outputs."""
import pytest
import torch

from kiln import ir
from kiln.ir import gguf as gguf_ops
from kiln.model.layers import cpu_gemm
from kiln.model.layers.vocab_embedding import (
    ParallelLMHead,
    VocabParallelEmbedding,
    embed_from_head_blocks,
)
from kiln.native import gguf_matmul

from gguf_blocks import file_blocks, kernel_blocks, needs_kernel

NATIVE = ir.gguf_embedding.impls["native"]
QTYPES = sorted(gguf_matmul.QTYPES)


def _ids(vocab: int) -> torch.Tensor:
    """Every edge of a group of 16 and of the table, repeated, in a [2, n] batch."""
    edges = [0, 1, 15, 16, 17, vocab - 1, vocab - 2, 31, 0, vocab - 1]
    return torch.tensor(edges + [(7 * i) % vocab for i in range(20)]).view(2, -1)


@needs_kernel
@pytest.mark.parametrize("name", QTYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_and_native_are_the_dequantized_rows(name, dtype):
    qtype = gguf_matmul.QTYPES[name]
    vocab, hidden = 37, 512  # a last group of 5 rows and 11 padding ones
    blocks, values = kernel_blocks(name, vocab, hidden, seed=3)
    ids = _ids(vocab)
    want = values[ids].to(dtype)  # [2, n, hidden]
    ref = gguf_ops._gguf_embedding_ref(ids, blocks, qtype, vocab, hidden, dtype)
    assert ref.dtype == dtype and torch.equal(ref, want)
    args = (ids, blocks, qtype, vocab, hidden, dtype)
    assert NATIVE.supported(*args)
    got = torch.ops.kiln.gguf_embedding_native(*args)
    assert got.shape == want.shape and torch.equal(got, want)
    # no ids, and many (the kernel's threaded range)
    empty = torch.ops.kiln.gguf_embedding_native(ids[:, :0], *args[1:])
    assert empty.shape == (2, 0, hidden)
    many = torch.arange(vocab).repeat(8)
    assert torch.equal(torch.ops.kiln.gguf_embedding_native(many, *args[1:]),
                       values[many].to(dtype))
    # int32 ids, as F.embedding takes them
    assert NATIVE.supported(ids.int(), *args[1:])
    assert torch.equal(torch.ops.kiln.gguf_embedding_native(ids.int(), *args[1:]), want)


@needs_kernel
def test_an_id_outside_the_vocabulary_is_an_index_error():
    blocks, _ = kernel_blocks("Q8_0", 20, 64)
    for bad in (20, 31, -1):  # 31: a padding row of the last group, still outside
        ids = torch.tensor([0, bad])
        with pytest.raises(IndexError, match="outside the vocabulary"):
            torch.ops.kiln.gguf_embedding_native(ids, blocks, 8, 20, 64, torch.float32)
        with pytest.raises(IndexError, match="outside the vocabulary"):
            gguf_ops._gguf_embedding_ref(ids, blocks, 8, 20, 64, torch.float32)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tied_embedding_reads_the_heads_blocks_and_its_table_is_let_go(dtype):
    vocab, hidden = 50, 256
    rows, values = file_blocks("Q8_0", vocab, hidden, seed=5)
    embed = VocabParallelEmbedding(vocab, hidden, tp_rank=0, tp_size=1)
    head = ParallelLMHead(vocab, hidden, tp_rank=0, tp_size=1)
    head.tie_weights(embed)
    embed.weight.data = values.to(dtype)
    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.embed_tokens, model.lm_head = embed, head
    ids = _ids(vocab)
    hidden_in = torch.randn(3, hidden).to(dtype)
    before_rows, before_logits = embed(ids), head.compute_logits(hidden_in)
    assert cpu_gemm.attach_gguf_blocks(head, 8, rows)  # Q8_0 blocks pay in both dtypes
    assert embed_from_head_blocks(model)
    assert embed.table_blocks is head.cpu_blocks
    cpu_gemm.prepack_for_cpu(model)
    freed = cpu_gemm.release_dense_copies(model)
    assert freed == vocab * hidden * values.to(dtype).element_size()
    assert embed.weight.is_meta and head.weight is embed.weight
    assert torch.equal(embed(ids), before_rows)
    # the head multiplies by its blocks now (held x in int8 limbs): test_gguf_linear_op's bounds
    terms = hidden_in.double().abs() @ values.double().abs().T
    tol = 4e-6 if dtype == torch.float32 else 2 ** -7
    assert ((head.compute_logits(hidden_in).double() - before_logits.double()).abs()
            <= tol * terms).all()


@needs_kernel
def test_an_untied_or_dense_head_keeps_the_table():
    vocab, hidden = 32, 64
    embed = VocabParallelEmbedding(vocab, hidden, tp_rank=0, tp_size=1)
    head = ParallelLMHead(vocab, hidden, tp_rank=0, tp_size=1)
    model = torch.nn.Module()
    model.model = torch.nn.Module()
    model.model.embed_tokens, model.lm_head = embed, head
    assert not embed_from_head_blocks(model)  # untied
    head.tie_weights(embed)
    assert not embed_from_head_blocks(model)  # tied, but the head keeps no blocks
    assert embed.table_blocks is None
