"""vLLM's repetition detection: the pure check on a token list, its settings' refusals, the
core's stop check (finish_reason "repetition", after min_tokens) and the process wire."""
import random

import msgspec
import pytest

from kiln.core.core_messages import decode_params, encode_params
from kiln.core.request import Request, RequestStatus
from kiln.core.request_progress import append_sampled, check_stop
from kiln.repetition_detection import (
    RepetitionDetectionParams,
    RepetitionTracker,
    ends_in_repetition,
)
from kiln.sampling_params import SamplingParams


def _rd(most, count, least=0):
    return RepetitionDetectionParams(max_pattern_size=most, min_pattern_size=least,
                                     min_count=count)


def test_a_pattern_repeated_at_the_end_is_found_for_its_sizes_only():
    abc = [1, 2, 3] * 3
    assert ends_in_repetition([9, *abc], _rd(3, 3))
    assert not ends_in_repetition([9, *abc], _rd(2, 3))  # a pattern of 3 is past the sizes
    assert not ends_in_repetition([9, *abc], _rd(3, 4))  # three times, not four
    assert not ends_in_repetition([*abc, 4], _rd(3, 2))  # not at the end
    assert ends_in_repetition([5, 5], _rd(1, 2)) and not ends_in_repetition([5], _rd(1, 2))
    assert not ends_in_repetition([5, 5, 5, 5], _rd(4, 2, least=3))  # "5 5 5" needs 6 tokens
    assert ends_in_repetition([7, 5, 5, 5, 5, 5, 5], _rd(4, 2, least=3))
    # almost periodic: only the last token of the earlier copy differs
    assert not ends_in_repetition([1, 2, 4, 1, 2, 3], _rd(3, 2))


def _vllm_check(tokens, params) -> bool:
    """vLLM's definition, written out: the last size x min_count tokens periodic with period
    `size`, for some size in [min_pattern_size or 1, max_pattern_size]."""
    count = params.min_count
    for size in range(max(params.min_pattern_size, 1), params.max_pattern_size + 1):
        if size * count <= len(tokens) and all(
                tokens[-k] == tokens[-(size * m + k)]
                for k in range(1, size + 1) for m in range(1, count)):
            return True
    return False


def test_the_running_check_agrees_with_vllms_after_every_token_and_multi_token_step():
    rng = random.Random(0)
    for _ in range(1500):
        most = rng.randint(1, 7)
        params = _rd(most, rng.randint(2, 4), least=rng.randint(0, most))
        tokens, tracker, vocab = [], RepetitionTracker(params), rng.randint(1, 3)
        while len(tokens) < 40:
            tokens += [rng.randint(0, vocab) for _ in range(rng.choice((1, 1, 3)))]
            assert tracker.update(tokens) == _vllm_check(tokens, params), (tokens, params)
            assert tracker.update(tokens) == _vllm_check(tokens, params)  # nothing new
            assert ends_in_repetition(tokens, params) == _vllm_check(tokens, params)
    tracker = RepetitionTracker(_rd(2, 2))
    assert not tracker.update([1, 2, 1, 3, 3, 1])
    assert tracker.update([1, 2, 1, 2])  # not the list that grew: taken from its start


class _CountingList(list):
    """An output list that counts the tokens read from it."""
    reads = 0

    def __getitem__(self, index):
        got = super().__getitem__(index)
        type(self).reads += len(got) if isinstance(index, slice) else 1
        return got


def test_each_tokens_check_reads_the_new_token_only_not_the_output():
    """The core's step loop checks every running request after each token: a long output of
    few distinct tokens (allowed_token_ids) and a wide check (1024 tokens x 32 times) must not
    make that check cost size x min_count per token (it took 80 ms a token, stalling every
    request in the batch)."""
    rng = random.Random(0)
    output = _CountingList(0 if rng.random() < 0.9 else 1 for _ in range(20000))
    request = Request("r", [1], SamplingParams(max_tokens=30000, repetition_detection=dict(
        max_pattern_size=1024, min_count=32)))
    request.output_token_ids = output
    assert not check_stop(request, max_model_len=40000)
    _CountingList.reads = 0
    for token in (1, 0, 0, 1, 0):
        output.append(token)
        assert not check_stop(request, max_model_len=40000)
    assert _CountingList.reads <= 2 * 5


@pytest.mark.parametrize("fields,message", [
    (dict(max_pattern_size=-1), r"repetition_detection\.max_pattern_size must be an integer"),
    (dict(max_pattern_size=2, min_count=1), r"min_count must be >= 2 where .*max_pattern_size"),
    (dict(max_pattern_size=2, min_pattern_size=3, min_count=2), r"min_pattern_size must be <="),
    (dict(min_count=3), r"max_pattern_size must be > 0 where"),
    (dict(max_pattern_size=5000, min_count=2), r"max_pattern_size must be at most 1024"),
    # no 64-bit integer on the process wire (msgpack) holds it: refused, not a crash there
    (dict(max_pattern_size=2, min_count=10 ** 30), r"min_count must be at most 9223372036854775807"),
])
def test_bad_settings_are_refused_naming_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        RepetitionDetectionParams(**fields)
    with pytest.raises(ValueError, match=message):  # vLLM's dict form
        SamplingParams(repetition_detection=fields)


def _run(params: SamplingParams, tokens: list[int]) -> Request:
    request = Request("r", [1, 2], params)
    for token in tokens:
        request.output_token_ids.append(token)
        if check_stop(request, max_model_len=100):
            break
    return request


def test_the_core_ends_a_repeating_request_after_min_tokens_as_vllm():
    rd = dict(max_pattern_size=2, min_count=3)
    request = _run(SamplingParams(max_tokens=20, repetition_detection=rd), [4, 8, 8, 8, 9, 9])
    assert request.output_token_ids == [4, 8, 8, 8]
    assert request.status == RequestStatus.FINISHED_REPETITION
    assert (request.get_finish_reason(), request.stop_reason) == ("repetition",
                                                                  "repetition_detected")
    held = _run(SamplingParams(max_tokens=20, min_tokens=5, repetition_detection=rd),
                [4, 8, 8, 8, 8, 9])
    assert held.output_token_ids == [4, 8, 8, 8, 8]  # not before min_tokens
    off = _run(SamplingParams(max_tokens=6), [8] * 6)
    assert off.get_finish_reason() == "length"


def test_a_multi_token_step_is_cut_where_the_repetition_completes():
    """Speculative decoding accepts several tokens in one step: each is checked as it is
    appended (vLLM's order), so the output ends at the token completing the pattern, ahead
    of a stop token later in the same step, and not before min_tokens."""
    rd = dict(max_pattern_size=2, min_count=3)
    request = Request("r", [1, 2], SamplingParams(max_tokens=20, stop_token_ids=[99],
                                                  repetition_detection=rd))
    new, error = append_sampled(request, [4, 8, 8, 8, 99, 5], max_model_len=100)
    assert (new, error, request.get_finish_reason()) == ([4, 8, 8, 8], None, "repetition")
    held = Request("r", [1, 2], SamplingParams(max_tokens=20, min_tokens=6,
                                               repetition_detection=rd))
    assert append_sampled(held, [4, 8, 8, 8, 8], max_model_len=100)[0] == [4, 8, 8, 8, 8]
    assert not held.is_finished()
    assert append_sampled(held, [8, 3], max_model_len=100)[0] == [8]  # 6 tokens, repeating
    assert held.get_finish_reason() == "repetition"


def test_it_crosses_to_the_core_process():
    params = SamplingParams(repetition_detection=dict(max_pattern_size=4, min_count=2))
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(encode_params(params)))
    assert decode_params(wire).repetition_detection == _rd(4, 2)
    most = SamplingParams(repetition_detection=dict(max_pattern_size=1024, min_count=2 ** 63 - 1))
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(encode_params(most)))
    assert decode_params(wire).repetition_detection == most.repetition_detection
