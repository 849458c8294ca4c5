"""The n-gram proposer (vLLM's NgramProposer) and --speculative-config, without a model."""
import random

import pytest

from kiln.config.speculative_config import SpeculativeConfig
from kiln.errors import ConfigError
from kiln.spec_decode.ngram_proposer import propose_ngram


def reference(tokens, min_n, max_n, k):
    """vLLM's KMP search (_find_longest_matched_ngram_and_propose_tokens), transcribed."""
    total = len(tokens)
    if total < min_n or k <= 0:
        return []
    rev = tokens[::-1]
    lps = [0] * max_n
    longest = position = prev = 0
    i = 1
    while i < total:
        if rev[prev] == rev[i]:
            prev += 1
            if prev >= longest:
                longest, position = prev, i
            if i < max_n:
                lps[i] = prev
            if prev == max_n:
                prev = lps[max_n - 1]
            i += 1
        elif prev != 0:
            prev = lps[prev - 1]
        else:
            i += 1
    if longest < min_n:
        return []
    start = total - 1 - position + longest
    return tokens[start:start + k]


def test_longest_ngram_first_and_its_earliest_occurrence():
    # the last 3 tokens (7 8 9) occur at 1; the last 2 (8 9) also at 5, but longer wins
    tokens = [1, 7, 8, 9, 4, 8, 9, 5, 6, 7, 8, 9]
    assert propose_ngram(tokens, 1, 3, 2) == [4, 8]
    # only up to 2: (8 9) first occurs at 2, followed by 4 8 9 ...
    assert propose_ngram(tokens, 1, 2, 3) == [4, 8, 9]
    # the suffix itself does not count; nothing shorter than min_n
    assert propose_ngram([1, 2, 3, 4], 1, 3, 3) == []
    assert propose_ngram([5, 1, 2, 9, 2], 2, 3, 3) == []
    assert propose_ngram([5, 1, 2, 9, 2], 1, 3, 3) == [9, 2]
    # proposals stop at the end of the tokens (an overlapping occurrence)
    assert propose_ngram([3, 3, 3], 1, 2, 5) == [3]
    assert propose_ngram([1, 2, 3], 1, 2, 0) == []


def test_matches_vllm_kmp_search_on_random_sequences():
    rng = random.Random(0)
    for case in range(3000):
        vocab = rng.choice([2, 3, 5, 20])
        tokens = [rng.randrange(vocab) for _ in range(rng.randrange(1, 40))]
        lo = rng.randrange(1, 4)
        hi = lo + rng.randrange(0, 4)
        k = rng.randrange(1, 6)
        assert propose_ngram(tokens, lo, hi, k) == reference(tokens, lo, hi, k), \
            (case, tokens, lo, hi, k)


def test_config_defaults_and_limits_are_vllms():
    c = SpeculativeConfig.from_value('{"method": "ngram", "num_speculative_tokens": 3}')
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (5, 5)
    c = SpeculativeConfig.from_value({"method": "ngram", "num_speculative_tokens": 2,
                                      "prompt_lookup_max": 4})
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (4, 4)
    c = SpeculativeConfig(method="ngram", num_speculative_tokens=2, prompt_lookup_min=2)
    assert (c.prompt_lookup_min, c.prompt_lookup_max) == (2, 2)
    assert SpeculativeConfig.from_value({"model": "[ngram]", "num_speculative_tokens": 1}
                                        ).method == "ngram"
    assert SpeculativeConfig.from_value(None) is None and SpeculativeConfig.from_value({}) is None
    with pytest.raises(AttributeError):
        c.num_speculative_tokens = 4  # frozen
    bad = [({"method": "ngram"}, "num_speculative_tokens is required"),
           # vLLM: "num_speculative_tokens was provided but without speculative model"
           ({"num_speculative_tokens": 3}, "neither a method nor a model"),
           ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be"),
           ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0},
            "prompt_lookup_min must be"),
           ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
             "prompt_lookup_max": 2}, "prompt_lookup_min=4 must be <= prompt_lookup_max=2"),
           ({"method": "eagle3", "num_speculative_tokens": 2},
            "needs speculative_config.model, the EAGLE-3 head"),
           ({"method": "suffix", "num_speculative_tokens": 2},
            "speculative_config.method='suffix'"),
           ({"method": "medusa", "num_speculative_tokens": 2}, "speculative_config.method"),
           ({"method": "mtp", "num_speculative_tokens": 1}, "speculative_config.method"),
           ({"method": "ngram", "model": "org/draft", "num_speculative_tokens": 2},
            "speculative_config.model"),
           ({"method": "ngram", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 1},
            "speculative_config.draft_tensor_parallel_size"),
           ("{not json", "not a JSON object")]
    for value, message in bad:
        with pytest.raises(ConfigError, match="--speculative-config") as e:
            SpeculativeConfig.from_value(value)
        assert message in str(e.value), (value, str(e.value))
        if "method" in message:
            assert "ngram" in str(e.value)  # says what is taken


def test_flag_is_taken_by_engine_commands_and_refuses_other_methods(capsys):
    from kiln.engine.arg_utils import EngineArgs
    from kiln.entrypoints.cli.main import build_parser

    parser = build_parser()
    for argv in (["serve"], ["generate"], ["bench", "latency"]):
        args = parser.parse_args([*argv, "--speculative-config",
                                  '{"method": "ngram", "num_speculative_tokens": 3}'])
        engine_args = EngineArgs.from_cli_args(args)
        assert SpeculativeConfig.from_value(engine_args.speculative_config
                                            ).num_speculative_tokens == 3
        # a child command gets it back
        again = parser.parse_args([*argv, *engine_args.to_cli_args()])
        assert EngineArgs.from_cli_args(again) .speculative_config is not None
    with pytest.raises(ConfigError, match="speculative_config.method='medusa'"):
        EngineArgs(speculative_config={"method": "medusa", "num_speculative_tokens": 2,
                                       "model": "x"}).create_kiln_config()
    with pytest.raises(ConfigError, match="--pipeline-parallel-size 2"):
        EngineArgs(speculative_config={"method": "ngram", "num_speculative_tokens": 2},
                   pipeline_parallel_size=2, load_format="dummy").create_kiln_config()


def test_token_array_follows_the_request_as_it_grows():
    from kiln.core.request import Request
    from kiln.sampling_params import SamplingParams
    from kiln.spec_decode.scheduling import token_array

    request = Request("r", list(range(5)), SamplingParams())
    assert token_array(request).tolist() == [0, 1, 2, 3, 4]
    for step in range(300):
        request.output_token_ids.extend([step % 7] * (1 + step % 3))
        if step % 5:
            assert token_array(request).tolist() == request.all_token_ids
