"""Capture-size lists, the padding table and the CUDAGraphMode halves: pure, no GPU, no model."""
import dataclasses

import pytest

from kiln.cudagraphs.dispatcher import (
    build_padding_table,
    default_capture_sizes,
    pad_to_capture_size,
    resolve_capture_sizes,
)
from kiln.cudagraphs.mode import BatchDescriptor, CUDAGraphMode

M = CUDAGraphMode


@pytest.mark.parametrize("max_num_seqs, max_tokens, expected", [
    (1, 2048, [1, 2]),  # min(2 x 1, 512) = 2
    (2, 2048, [1, 2, 4]),
    (3, 2048, [1, 2, 4]),  # limit 6: no multiple of 8 fits
    (4, 2048, [1, 2, 4, 8]),
    (16, 2048, [1, 2, 4, 8, 16, 24, 32]),
    (16, 20, [1, 2, 4, 8, 16]),  # capped by the token budget
    (64, 2048, [1, 2, 4] + list(range(8, 129, 8))),
])
def test_default_capture_sizes(max_num_seqs, max_tokens, expected):
    assert default_capture_sizes(max_num_seqs, max_tokens) == expected


def test_default_capture_sizes_stop_at_512():
    sizes = default_capture_sizes(1024, 8192)
    assert sizes[:4] == [1, 2, 4, 8] and sizes[-1] == 512 and len(sizes) == 3 + 64
    assert all(b - a == 8 for a, b in zip(sizes[3:], sizes[4:]))


def test_max_cudagraph_capture_size_sets_the_limit():
    assert default_capture_sizes(64, 2048, max_capture_size=20) == [1, 2, 4, 8, 16]
    # An explicit maximum may go past 2 x max_num_seqs but never past the token budget.
    assert default_capture_sizes(4, 2048, max_capture_size=32)[-1] == 32
    assert default_capture_sizes(4, 24, max_capture_size=32)[-1] == 24
    assert default_capture_sizes(4, 2048, max_capture_size=0) == []


def test_explicit_capture_sizes_sorted_deduped():
    assert resolve_capture_sizes([8, 1, 4, 8, 2], 4, 2048) == [1, 2, 4, 8]
    assert resolve_capture_sizes([], 4, 2048) == []
    assert resolve_capture_sizes(None, 4, 2048) == [1, 2, 4, 8]


@pytest.mark.parametrize("sizes, limit, match", [
    ([0, 4], None, "positive integers"),
    ([2.5], None, "positive integers"),
    ([4, 4096], None, "max_num_batched_tokens.*compilation_config.cudagraph_capture_sizes"),
    ([4, 64], 32, "max_cudagraph_capture_size.*compilation_config.cudagraph_capture_sizes"),
])
def test_explicit_capture_sizes_validated(sizes, limit, match):
    with pytest.raises(ValueError, match=match):
        resolve_capture_sizes(sizes, 64, 2048, limit)


def test_padding_table():
    sizes = [1, 2, 4, 8, 16]
    table = build_padding_table(sizes)
    assert len(table) == 17
    assert table[:10] == [0, 1, 2, 4, 4, 8, 8, 8, 8, 16]
    assert table[16] == 16
    for n in range(1, 17):
        assert table[n] == pad_to_capture_size(n, sizes) >= n
    assert pad_to_capture_size(17, sizes) is None
    assert build_padding_table([]) == [0]


def test_mode_halves():
    assert (M.FULL_AND_PIECEWISE.decode_mode(), M.FULL_AND_PIECEWISE.mixed_mode()) == \
        (M.FULL, M.PIECEWISE)
    assert (M.FULL_DECODE_ONLY.decode_mode(), M.FULL_DECODE_ONLY.mixed_mode()) == (M.FULL, M.NONE)
    for single in (M.NONE, M.PIECEWISE, M.FULL):
        assert single.decode_mode() is single.mixed_mode() is single
        assert single.is_runtime_mode() and not single.separate_routine()
    assert [m.name for m in M if m.has_full_cudagraphs()] == \
        ["FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE"]
    assert [m.name for m in M if m.has_piecewise_cudagraphs()] == \
        ["PIECEWISE", "FULL_AND_PIECEWISE"]


def test_mode_parse():
    assert M.parse("full_and_piecewise") is M.FULL_AND_PIECEWISE
    assert M.parse("PIECEWISE") is M.PIECEWISE
    assert M.parse(2) is M.FULL and M.parse("0") is M.NONE
    assert M.parse(M.FULL_DECODE_ONLY) is M.FULL_DECODE_ONLY
    for bad in ("fast", 7, True):
        with pytest.raises(ValueError, match="cudagraph_mode must be one of"):
            M.parse(bad)


def test_batch_descriptor_is_a_hashable_frozen_key():
    d = BatchDescriptor(8, 8, True)
    assert {d: 1}[BatchDescriptor(8, 8, True)] == 1
    assert d.non_uniform() == BatchDescriptor(8) == BatchDescriptor(8, None, False)
    with pytest.raises(dataclasses.FrozenInstanceError):
        d.num_tokens = 4
