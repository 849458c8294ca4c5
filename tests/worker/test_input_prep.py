"""Pure input-preparation functions: offsets, positions, slot mapping, which requests sample,
and the runner's persistent InputBatch tables."""
import numpy as np
import pytest

from kiln.sampling_params import SamplingParams
from kiln.worker import input_prep
from kiln.worker.input_batch import CachedRequestState, InputBatch


def test_query_start_loc_and_request_indices():
    n = np.array([3, 1, 2])
    assert input_prep.query_start_loc(n).tolist() == [0, 3, 4, 6]
    assert input_prep.query_start_loc(n).dtype == np.int32
    assert input_prep.token_request_indices(n).tolist() == [0, 0, 0, 1, 2, 2]


def test_positions_continue_from_computed():
    pos = input_prep.positions(np.array([0, 7, 4]), np.array([3, 1, 2]))
    assert pos.tolist() == [0, 1, 2, 7, 4, 5]
    assert pos.dtype == np.int64


def test_slot_mapping_crosses_block_boundary():
    bs = 4
    table = np.array([[9, 2, 0], [5, 6, 7]], dtype=np.int32)
    num_sched, num_computed = np.array([3, 2]), np.array([2, 7])
    pos = input_prep.positions(num_computed, num_sched)  # [2, 3, 4] and [7, 8]
    slots = input_prep.slot_mapping(table, input_prep.token_request_indices(num_sched), pos, bs)
    assert slots.tolist() == [9 * 4 + 2, 9 * 4 + 3, 2 * 4 + 0, 6 * 4 + 3, 7 * 4 + 0]


def test_sampling_mask_and_logits_indices():
    num_computed = np.array([0, 10, 5])
    num_sched = np.array([4, 1, 3])
    num_tokens = np.array([8, 11, 8])  # first is a partial prefill chunk
    mask = input_prep.sampling_mask(num_computed, num_sched, num_tokens)
    assert mask.tolist() == [False, True, True]
    qsl = input_prep.query_start_loc(num_sched)
    assert input_prep.logits_indices(qsl, mask).tolist() == [4, 7]
    assert input_prep.as_slice(input_prep.logits_indices(qsl, mask)) is None  # 4, 7: a gap


def test_consecutive_logits_rows_become_a_slice():
    decode = input_prep.query_start_loc(np.array([1, 1, 1]))  # three one-token requests
    rows = input_prep.logits_indices(decode, np.array([True, True, True]))
    assert input_prep.as_slice(rows) == slice(0, 3)
    assert input_prep.as_slice(np.array([7])) == slice(7, 8)  # one request's last token
    assert input_prep.as_slice(np.array([0, 2])) is None
    assert input_prep.as_slice(np.array([], dtype=np.int64)) is None
    hidden = np.arange(12).reshape(6, 2)
    for idx in ([1, 2, 3], [5], [0, 1]):  # the slice picks the rows the index would
        assert (hidden[input_prep.as_slice(np.array(idx))] == hidden[idx]).all()


def _state(rid, prompt, out=(), blocks=(0,)):
    return CachedRequestState(rid, list(prompt), list(out), SamplingParams(), None, list(blocks), 0)


def test_input_batch_rows_tokens_blocks():
    batch = InputBatch(max_num_seqs=2, max_model_len=8, max_blocks_per_req=2)
    a, b = _state("a", [1, 2, 3], [4]), _state("b", [5], blocks=[3])
    ra, rb = batch.add(a), batch.add(b)
    assert {ra, rb} == {0, 1}
    assert batch.token_ids[ra, :4].tolist() == [1, 2, 3, 4] and batch.num_tokens[ra] == 4
    batch.append_token(rb, 9)
    assert batch.token_ids[rb, :2].tolist() == [5, 9]
    batch.append_block_ids(rb, [7])
    assert batch.block_table[rb].tolist() == [3, 7]
    with pytest.raises(ValueError, match="max_blocks_per_req"):
        batch.append_block_ids(rb, [8])
    with pytest.raises(RuntimeError, match="max_num_seqs"):
        batch.add(_state("c", [1]))
    batch.remove(ra)
    assert batch.add(_state("c", [6, 6])) == ra
    assert batch.token_ids[ra, :2].tolist() == [6, 6] and batch.num_blocks[ra] == 1


def test_input_batch_rejects_too_long_request():
    batch = InputBatch(max_num_seqs=1, max_model_len=4, max_blocks_per_req=1)
    with pytest.raises(ValueError, match="max_model_len"):
        batch.add(_state("x", [1] * 5))
    assert batch.add(_state("y", [1] * 4)) == 0  # the refusal kept the only row free


def test_check_step_names_the_request_the_tables_cannot_hold():
    ids = ["a", "b"]
    computed, known, blocks = np.array([0, 8]), np.array([5, 9]), np.array([2, 3])
    input_prep.check_step(ids, computed, np.array([5, 1]), known, blocks, block_size=4)
    with pytest.raises(RuntimeError, match=r"'a' scheduled 6 tokens from position 0 but only 5"):
        input_prep.check_step(ids, computed, np.array([6, 1]), known, blocks, block_size=4)
    # b runs to position 8, in its third block: it holds two
    with pytest.raises(RuntimeError, match=r"'b' runs to position 8 but holds only 2 KV blocks"):
        input_prep.check_step(ids, computed, np.array([5, 1]), known, np.array([2, 2]),
                              block_size=4)
