"""--runner / --task / --pooler-config resolution (vLLM's names and defaults), a
sentence-transformers checkpoint's own pooling, matryoshka `dimensions`, and the finishing of a
pooled vector (first N entries, then L2-normalized)."""
import json

import pytest
import torch

from kiln.engine.arg_utils import EngineArgs
from kiln.entrypoints.cli.main import build_parser
from kiln.errors import ConfigError
from kiln.pooling.outputs import PoolingParams, finish_vector
from kiln.pooling.pooler_config import (
    PoolerConfig,
    checkpoint_pooling,
    resolve_pooler_config,
    resolve_runner,
)
from kiln.pooling.pooling_inputs import check_dimensions


def test_runner_and_task_resolve_as_vllms():
    assert resolve_runner("auto", None) == "generate"
    assert resolve_runner("pooling", None) == resolve_runner("auto", "embed") == "pooling"
    assert resolve_runner("generate", "generate") == "generate"
    with pytest.raises(ConfigError, match="--runner 'draft' is not supported"):
        resolve_runner("draft", None)
    with pytest.raises(ConfigError, match="--runner generate and --task embed disagree"):
        resolve_runner("generate", "embed")


def test_pooler_config_defaults_flags_and_refusals(tmp_path):
    assert resolve_pooler_config("pooling", None, None, tmp_path) == PoolerConfig("LAST", True)
    assert resolve_pooler_config("pooling", '{"pooling_type": "mean"}', None, None) == \
        PoolerConfig("MEAN", True)
    # the newer name wins over the older one, key by key
    assert resolve_pooler_config("pooling", {"normalize": False}, {"pooling_type": "CLS"},
                                 None) == PoolerConfig("CLS", False)
    assert resolve_pooler_config("generate", None, None, None) is None
    with pytest.raises(ConfigError, match=r"--pooler-config: \['step_tag_id'\] not supported"):
        resolve_pooler_config("pooling", {"step_tag_id": 3}, None, None)
    # vLLM's older activation names are use_activation's
    assert resolve_pooler_config("pooling", {"softmax": False}, None, None, "classify") == \
        PoolerConfig("LAST", True, "classify", False)
    with pytest.raises(ConfigError, match="activation and use_activation disagree"):
        resolve_pooler_config("pooling", {"activation": False, "use_activation": True}, None,
                              None)
    with pytest.raises(ConfigError, match="--pooler-config: normalize must be true or false"):
        resolve_pooler_config("pooling", {"normalize": "yes"}, None, None)
    with pytest.raises(ConfigError, match="--pooler-config must be a JSON object"):
        resolve_pooler_config("pooling", "{bad", None, None)


def test_sentence_transformers_checkpoint_sets_pooling(tmp_path):
    (tmp_path / "modules.json").write_text(json.dumps([
        {"idx": 0, "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(
        {"pooling_mode_mean_tokens": True, "pooling_mode_lasttoken": False}))
    assert checkpoint_pooling(tmp_path) == {"normalize": True, "pooling_type": "MEAN"}
    # a flag still wins
    assert resolve_pooler_config("pooling", {"pooling_type": "LAST"}, None, tmp_path) == \
        PoolerConfig("LAST", True)


def test_cli_flags_reach_engine_args_and_back():
    args = build_parser().parse_args(["serve", "--runner", "pooling", "--pooler-config",
                                      '{"pooling_type": "MEAN"}'])
    engine_args = EngineArgs.from_cli_args(args)
    assert engine_args.runner == "pooling"
    assert engine_args.pooler_config == '{"pooling_type": "MEAN"}'
    argv = EngineArgs(runner="pooling", pooler_config={"pooling_type": "CLS"}).to_cli_args()
    assert argv == ["--runner", "pooling", "--pooler-config", '{"pooling_type": "CLS"}']
    assert EngineArgs(pooler_config=PoolerConfig("MEAN", False)).to_cli_args() == [
        "--pooler-config", '{"pooling_type": "MEAN", "normalize": false}']
    again = EngineArgs.from_cli_args(build_parser().parse_args(["serve", *argv]))
    assert json.loads(again.pooler_config) == {"pooling_type": "CLS"}
    task = build_parser().parse_args(["serve", "--task", "embed"])
    assert EngineArgs.from_cli_args(task).task == "embed"
    for flags in (["--task", "classify"], ["--task", "score"], ["--convert", "classify"]):
        parsed = EngineArgs.from_cli_args(build_parser().parse_args(["serve", *flags]))
        assert getattr(parsed, flags[0][2:]) == flags[1]
    for flags in (["--task", "reward"], ["--convert", "reward"]):
        with pytest.raises(SystemExit):  # argparse: "argument --task: invalid choice"
            build_parser().parse_args(["serve", *flags])


class _Config:
    model = "m"
    hidden_size = 64

    def __init__(self, **hf):
        self.hf_config = type("HF", (), hf)()


def test_dimensions_only_for_matryoshka_models():
    check_dimensions(None, _Config())
    with pytest.raises(ValueError, match="does not support matryoshka representation"):
        check_dimensions(16, _Config())
    check_dimensions(16, _Config(is_matryoshka=True))
    check_dimensions(32, _Config(matryoshka_dimensions=[16, 32]))
    with pytest.raises(ValueError, match=r"only supports \[16, 32\] matryoshka dimensions"):
        check_dimensions(8, _Config(matryoshka_dimensions=[16, 32]))
    with pytest.raises(ValueError, match="dimensions must be an integer greater than 0"):
        check_dimensions(0, _Config(is_matryoshka=True))


def test_finish_vector_truncates_then_normalizes():
    raw = torch.arange(1.0, 9.0)
    got = finish_vector(raw.tolist(), PoolingParams(dimensions=4), True)
    torch.testing.assert_close(got, raw[:4] / raw[:4].norm())
    assert torch.equal(finish_vector(raw.tolist(), PoolingParams(normalize=False), True), raw)
    torch.testing.assert_close(finish_vector(raw.tolist(), None, True), raw / raw.norm())
