"""vLLM's repetition detection: the pure check on a token list, its settings' refusals, the
core's stop check (finish_reason "repetition", after min_tokens) and the process wire."""
import msgspec
import pytest

from kiln.core.core_messages import decode_params, encode_params
from kiln.core.request import Request, RequestStatus
from kiln.core.request_progress import check_stop
from kiln.repetition_detection import RepetitionDetectionParams, ends_in_repetition
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


@pytest.mark.parametrize("fields,message", [
    (dict(max_pattern_size=-1), r"repetition_detection\.max_pattern_size must be an integer"),
    (dict(max_pattern_size=2, min_count=1), r"min_count must be >= 2 where .*max_pattern_size"),
    (dict(max_pattern_size=2, min_pattern_size=3, min_count=2), r"min_pattern_size must be <="),
    (dict(min_count=3), r"max_pattern_size must be > 0 where"),
    (dict(max_pattern_size=5000, min_count=2), r"max_pattern_size must be at most 1024"),
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


def test_it_crosses_to_the_core_process():
    params = SamplingParams(repetition_detection=dict(max_pattern_size=4, min_count=2))
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(encode_params(params)))
    assert decode_params(wire).repetition_detection == _rd(4, 2)
