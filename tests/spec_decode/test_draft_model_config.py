"""--speculative-config method='draft_model' as vLLM takes it: the method inferred from
'model', the draft's ModelConfig built beside the target's, and what Kiln refuses by name (a
draft of another vocabulary, tensor / pipeline parallelism, vLLM's other draft options)."""
import pytest

from kiln.config.speculative_config import SpeculativeConfig
from kiln.engine.arg_utils import EngineArgs
from kiln.errors import ConfigError


def test_method_is_inferred_from_model_as_vllm_does():
    assert SpeculativeConfig.from_value({"model": "org/small", "num_speculative_tokens": 2}
                                        ).method == "draft_model"
    assert SpeculativeConfig.from_value({"model": "ngram", "num_speculative_tokens": 2}
                                        ).method == "ngram"
    spec = SpeculativeConfig.from_value(
        '{"method": "draft_model", "model": "m", "num_speculative_tokens": 4, '
        '"draft_tensor_parallel_size": 1, "enforce_eager": true}')
    assert spec.to_dict() == {"method": "draft_model", "model": "m", "num_speculative_tokens": 4,
                              "draft_tensor_parallel_size": 1, "enforce_eager": True}
    assert SpeculativeConfig.from_value(spec.to_dict()) == spec


@pytest.mark.parametrize("value, message", [
    ({"method": "draft_model", "num_speculative_tokens": 2}, "needs speculative_config.model"),
    ({"method": "draft_model", "model": "m"}, "num_speculative_tokens is required"),
    ({"model": "m", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 0},
     "draft_tensor_parallel_size must be"),
    ({"model": "m", "num_speculative_tokens": 2, "tensor_parallel_size": 1},
     "draft_tensor_parallel_size"),
    ({"model": "m", "num_speculative_tokens": 2, "draft_sample_method": "probabilistic"},
     "draft_sample_method='probabilistic'"),
    ({"model": "m", "num_speculative_tokens": 2, "rejection_sample_method": "block"},
     "rejection_sample_method"),
    ({"model": "m", "num_speculative_tokens": 2, "max_model_len": 0}, "max_model_len must be"),
    ({"model": "m", "num_speculative_tokens": 2, "prompt_lookup_max": 3}, "n-gram's"),
    ({"method": "ngram", "num_speculative_tokens": 2, "enforce_eager": True},
     "speculative_config.enforce_eager"),
])
def test_refusals_name_the_field(value, message):
    with pytest.raises(ConfigError, match="--speculative-config") as e:
        SpeculativeConfig.from_value(value)
    assert message in str(e.value), str(e.value)


def test_draft_model_config_follows_the_target(tiny_llama_dir, tmp_path):
    from checkpoints import make_tiny_checkpoint

    config = EngineArgs(model=str(tiny_llama_dir), dtype="float32", max_model_len=128,
                        speculative_config={"model": str(tiny_llama_dir),
                                            "num_speculative_tokens": 2}).create_kiln_config()
    draft = config.speculative_config.draft_model_config
    assert (draft.max_model_len, str(draft.torch_dtype), draft.vocab_size) == \
        (128, "torch.float32", config.model_config.vocab_size)

    def engine(draft, **kwargs):
        return EngineArgs(model=str(tiny_llama_dir), max_model_len=128, speculative_config={
            "model": str(draft), "num_speculative_tokens": 2}, **kwargs)

    other_vocab = make_tiny_checkpoint(tmp_path / "v", "llama", tie=False, vocab_size=256)
    with pytest.raises(ConfigError, match="vocab_size=256 .* must share the target's"):
        engine(other_vocab).create_kiln_config()
    with pytest.raises(ConfigError, match="speculative_config.model=.*missing"):
        engine(tmp_path / "missing").create_kiln_config()
    # a shorter draft is capped at its own length, as vLLM's (requests past it run undrafted)
    short = make_tiny_checkpoint(tmp_path / "s", "llama", tie=False, max_position_embeddings=64)
    spec = engine(short).create_kiln_config().speculative_config
    assert spec.draft_model_config.max_model_len == 64
    capped = EngineArgs(model=str(tiny_llama_dir), max_model_len=128, speculative_config={
        "model": str(tiny_llama_dir), "num_speculative_tokens": 2, "max_model_len": 32})
    assert capped.create_kiln_config().speculative_config.draft_model_config.max_model_len == 32
    # on the target's ranks (tests/distributed/test_tp_spec_decode.py); a draft tp other
    # than the target's is refused by field
    assert engine(tiny_llama_dir, tensor_parallel_size=2).create_kiln_config()
    for tp, draft_tp in ((2, 1), (1, 2)):
        with pytest.raises(ConfigError, match=f"draft_tensor_parallel_size={draft_tp} differs "
                                              f"from --tensor-parallel-size {tp}; the draft "
                                              r"\(method='draft_model'\) runs on the target's"):
            EngineArgs(model=str(tiny_llama_dir), max_model_len=128, tensor_parallel_size=tp,
                       speculative_config={"model": str(tiny_llama_dir),
                                           "num_speculative_tokens": 2,
                                           "draft_tensor_parallel_size": draft_tp}
                       ).create_kiln_config()
    with pytest.raises(ConfigError, match="--pipeline-parallel-size 2"):
        engine(tiny_llama_dir, pipeline_parallel_size=2).create_kiln_config()


def test_a_classifier_draft_is_refused_by_field(tiny_llama_dir, tiny_ce_llama_dir):
    """A *ForSequenceClassification checkpoint of the target's vocabulary was accepted as the
    draft and killed the engine core at its first step (no LM head to propose with)."""
    with pytest.raises(ConfigError, match=r"--speculative-config: the draft model .* is a "
                       r"LlamaForSequenceClassification \(a score head, no LM head\).*"
                       r"speculative_config.model a \*ForCausalLM checkpoint"):
        EngineArgs(model=str(tiny_llama_dir), max_model_len=128, speculative_config={
            "model": str(tiny_ce_llama_dir), "num_speculative_tokens": 2}).create_kiln_config()


@pytest.mark.parametrize("kwargs", [dict(runner="pooling"), dict(task="embed")])
def test_ngram_speculation_with_a_pooling_runner_is_refused(tiny_llama_dir, kwargs):
    """It was accepted and did nothing: a pooling model generates no tokens to draft."""
    with pytest.raises(ConfigError, match=r"--speculative-config \(method='ngram'\) drafts "
                       r"generated tokens, and --runner pooling .*drop --speculative-config or "
                       "--runner pooling"):
        EngineArgs(model=str(tiny_llama_dir), speculative_config={
            "method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 2},
            **kwargs).create_kiln_config()


def test_the_draft_compiles_under_mode_3_under_its_own_cache_key(tiny_llama_dir):
    """As an EAGLE head: compiled with a mode-3 target unless the draft's enforce_eager says
    not, keyed apart from the target even when it is the target's own checkpoint (its compiled
    range one sampled token a request wider than the target's budget)."""
    import dataclasses

    from kiln.spec_decode.draft_model_proposer import draft_compiles, draft_kiln_config

    def config(mode, **spec):
        return EngineArgs(model=str(tiny_llama_dir), max_model_len=128, max_num_seqs=4,
                          compilation_config={"mode": mode}, speculative_config={
                              "model": str(tiny_llama_dir), "num_speculative_tokens": 2,
                              **spec}).create_kiln_config()

    for mode, eager, compiles in ((3, None, True), (3, True, False), (0, None, False)):
        assert draft_compiles(config(mode, enforce_eager=eager)) == compiles
        assert draft_kiln_config(config(mode, enforce_eager=eager)).compilation_config.mode \
            == (3 if compiles else 0)
    target = config(3)
    draft = draft_kiln_config(target)
    assert draft.scheduler_config.max_num_batched_tokens == \
        target.scheduler_config.max_num_batched_tokens + 4
    assert draft.compute_hash() != target.compute_hash()
    assert draft.compute_hash() != dataclasses.replace(draft, is_draft=False).compute_hash()


@pytest.mark.parametrize("value, message", [
    ({"model": "m", "num_speculative_tokens": 2, "revision": 5},
     "speculative_config.revision must be a string, got 5"),
    ({"model": "m", "num_speculative_tokens": 2, "quantization": 8},
     "speculative_config.quantization must be a string"),
    ({"method": ["ngram"], "num_speculative_tokens": 2}, "speculative_config.method must be"),
    ({"model": 5, "num_speculative_tokens": 2}, "speculative_config.model must be a string"),
    ({"model": "m", "num_speculative_tokens": 2, "enforce_eager": "yes"},
     "speculative_config.enforce_eager must be true or false"),
    ({"method": "ngram", "num_speculative_tokens": 2, "parallel_drafting": 0},
     "speculative_config.parallel_drafting must be true or false, got 0"),
    ({"method": "ngram", "num_speculative_tokens": 2, "rejection_sample_method": 5},
     "speculative_config.rejection_sample_method must be a string"),
    ({"method": "ngram", "num_speculative_tokens": [3]},
     "num_speculative_tokens must be an integer > 0, got [3]"),
    ({"method": "ngram", "num_speculative_tokens": True},
     "num_speculative_tokens must be an integer > 0, got True"),
    ({"method": "ngram", "num_speculative_tokens": 2.0}, "num_speculative_tokens must be"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens must be"),
    ({"method": "ngram", "num_speculative_tokens": -1}, "num_speculative_tokens must be"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": [4]},
     "prompt_lookup_max must be an integer > 0"),
    ({"model": "m", "num_speculative_tokens": 2, "max_model_len": False},
     "max_model_len must be an integer > 0, got False"),
    ({"model": "m", "num_speculative_tokens": 2, "draft_tensor_parallel_size": "1"},
     "draft_tensor_parallel_size must be an integer > 0"),
    # LLM(speculative_config={...}): keys of mixed types made sorted() raise TypeError
    ({"method": "ngram", "num_speculative_tokens": 2, 1: 2, "x": 3},
     "speculative_config.1 is not supported"),
])
def test_a_field_of_the_wrong_type_is_refused_by_name(value, message):
    """Types as JSON gives them: a number where a string belongs (a revision), a bool where an
    int belongs (bool is an int in Python), a list anywhere."""
    with pytest.raises(ConfigError, match="--speculative-config") as e:
        SpeculativeConfig.from_value(value)
    assert message in str(e.value), str(e.value)


def test_num_speculative_tokens_is_capped_by_the_sequence_length_only(tiny_llama_dir):
    """vLLM sets no cap of its own: a large k is the caller's trade (more drafts wasted per
    rejection). Kiln refuses only a k no sequence can hold: 2**63 crashed the engine core on
    start (a counter per draft position), 10**8 took gigabytes."""
    assert SpeculativeConfig.from_value({"method": "ngram", "num_speculative_tokens": 4096}
                                        ).num_speculative_tokens == 4096
    assert SpeculativeConfig.from_value({"model": "m", "num_speculative_tokens": 64,
                                         "revision": "main"}).revision == "main"

    def config(k):
        return EngineArgs(model=str(tiny_llama_dir), max_model_len=128, speculative_config={
            "method": "ngram", "num_speculative_tokens": k}).create_kiln_config()

    assert config(127).speculative_config.num_speculative_tokens == 127
    for k in (128, 2**63):
        with pytest.raises(ConfigError, match=f"num_speculative_tokens={k} must be below "
                                              "--max-model-len 128"):
            config(k)
