"""vLLM's `--config FILE.yaml` (flags from a YAML mapping) for every `kiln` command; it was
refused as a flag Kiln has no counterpart for (helper-106)."""
import os
import subprocess
import sys

import pytest

from kiln.entrypoints.cli.config_file import flags_from_config_file
from kiln.entrypoints.cli.main import build_parser, dotted_flags_as_O, underscored_flags_dashed

from checkpoints import STORIES_DIR


def parse(argv):
    parser = build_parser()
    argv = flags_from_config_file(underscored_flags_dashed(argv), parser)
    return parser.parse_args(dotted_flags_as_O(argv))


def test_the_files_flags_and_the_command_line_winning(tmp_path):
    config = tmp_path / "serve.yaml"
    config.write_text("model: /m\nport: 8001\nmax_model_len: 64\nenforce-eager: true\n"
                      "enable-prefix-caching: false\ntrust-remote-code: false\n"
                      "served-model-name: [a, b]\ncompilation-config: {mode: 0}\n"
                      "optimization-level: 3\ntokenizer: null\n")
    args = parse(["serve", "--config", str(config)])
    assert (args.model, args.model_tag, args.port, args.max_model_len) == ("/m", None, 8001, 64)
    assert args.enforce_eager and not args.enable_prefix_caching and not args.trust_remote_code
    assert args.served_model_name == ["a", "b"] and args.compilation_config == {"mode": 0}
    assert args.optimization_level == 3 and args.tokenizer is None
    # the command line wins, wherever --config stands; a positional model over the file's
    args = parse(["serve", "--port", "9000", "/other", f"--config={config}",
                  "--max_model_len", "32", "--enable-prefix-caching"])
    assert (args.model_tag, args.model, args.port, args.max_model_len) == (
        "/other", None, 9000, 32)
    assert args.enable_prefix_caching
    config.write_text("num-prompts: 8\ninput-len: 16\nmax-model-len: 64\n")
    args = parse(["bench", "throughput", "--num-prompts", "3", "--config", str(config)])
    assert (args.num_prompts, args.input_len, args.max_model_len) == (3, 16, 64)


@pytest.mark.parametrize("text, message", [
    ("just text\n", "must be a YAML mapping of flag names to values"),
    ("a: [1\n", "is not valid YAML"),
    ("config: other.yaml\n", "names another config file"),
])
def test_a_bad_file_is_named(tmp_path, text, message):
    config = tmp_path / "c.yaml"
    config.write_text(text)
    with pytest.raises(ValueError, match=message):
        parse(["serve", "--config", str(config)])
    with pytest.raises(FileNotFoundError, match="--config /nowhere.yaml"):
        parse(["serve", "--config", "/nowhere.yaml"])
    with pytest.raises(ValueError, match="--config needs a YAML file"):
        parse(["serve", "--config"])


def test_the_file_is_read_as_yaml_reads_it(tmp_path):
    """UTF-8 whatever the locale (it was read in the locale's encoding: ASCII under LC_ALL=C
    without UTF-8 mode), and a byte that is no UTF-8 is named as this file's (it was 'error:
    'utf-8' codec can't decode byte 0xff', no file named)."""
    config = tmp_path / "c.yaml"
    config.write_bytes("served-model-name: модель\n".encode())
    run = [sys.executable, "-c", "import sys; sys.path.insert(0, 'tests'); from "
           "entrypoints.test_config_file import parse; "
           "print(ascii(parse(['serve', '/m', '--config', sys.argv[1]]).served_model_name))",
           str(config)]
    r = subprocess.run(run, capture_output=True, text=True, encoding="utf-8", timeout=120,
                       env={**os.environ, "LC_ALL": "C", "PYTHONUTF8": "0",
                            "PYTHONCOERCECLOCALE": "0"})
    assert r.returncode == 0 and r.stdout.strip() == ascii(["модель"]), r.stderr
    config.write_bytes(b"served-model-name: \xff\n")
    with pytest.raises(ValueError, match=f"--config {config} is not valid YAML"):
        parse(["serve", "--config", str(config)])


def test_generate_runs_from_a_config_file(tmp_path):
    config = tmp_path / "generate.yaml"
    config.write_text(f"model: {STORIES_DIR}\nenforce_eager: true\nkv-cache-memory: 0.02\n"
                      "max-model-len: 64\ntemperature: 0\nmax-tokens: 3\n")
    run = [sys.executable, "-m", "kiln.entrypoints.cli.main", "generate", "Tom"]
    r = subprocess.run([*run, "--config", str(config)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and r.stdout.strip(), r.stderr
    same = subprocess.run([*run, "--model", str(STORIES_DIR), "--enforce-eager",
                           "--kv-cache-memory", "0.02", "--max-model-len", "64",
                           "--temperature", "0", "--max-tokens", "3"],
                          capture_output=True, text=True, timeout=300)
    assert same.returncode == 0 and r.stdout == same.stdout
    (config.parent / "bad.yaml").write_text("[1, 2]\n")
    r = subprocess.run([*run, "--config", str(config.parent / "bad.yaml")],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("error: --config ")


def test_a_list_flag_in_the_file_leaves_the_positional_alone(tmp_path):
    """The file's flags went right after the command, before `kiln serve MODEL`'s model: a
    list flag (served-model-name, nargs +) took the model as one more name, as did a key the
    parser does not know; vLLM puts them after serve's model."""
    config = tmp_path / "c.yaml"
    config.write_text("served-model-name: my_model\n")
    args = parse(["serve", "/m", "--config", str(config), "--port", "9000"])
    assert (args.model_tag, args.served_model_name, args.port) == ("/m", ["my_model"], 9000)
    config.write_text("served-model-name: []\nstop: [x]\n")  # an empty list asks for nothing
    args = parse(["generate", "Tom", "--config", str(config)])
    assert (args.prompt, args.stop) == ("Tom", ["x"])
    config.write_text("served-model-name: []\n")
    args = parse(["serve", "/m", "--config", str(config)])
    assert (args.model_tag, args.served_model_name) == ("/m", None)


def test_a_repeatable_flag_from_the_file(tmp_path):
    """--stop is repeated (append), not a list flag: a list of two made the second an
    unrecognized argument, and a typed --stop added to the file's instead of winning."""
    config = tmp_path / "c.yaml"
    config.write_text("stop: [x, y]\n")
    assert parse(["generate", "Tom", "--config", str(config)]).stop == ["x", "y"]
    assert parse(["generate", "Tom", "--config", str(config), "--stop", "z"]).stop == ["z"]
    config.write_text("ir-op-priority: [rms_norm=native, silu_and_mul=torch]\n")
    args = parse(["serve", "/m", "--config", str(config)])
    assert args.model_tag == "/m"
    assert args.ir_op_priority == {"rms_norm": ["native"], "silu_and_mul": ["torch"]}


def test_a_dotted_key_sets_one_field(tmp_path):
    """compilation_config.pass_config.X: only the flag's name is dashed (the field was
    pass-config.X), false is the field's value (it was dropped as a --no- switch that does
    not exist) and true too (a bare flag that took the next argument as its value)."""
    config = tmp_path / "c.yaml"
    config.write_text("compilation_config.pass_config.fuse_norm_quant: true\n"
                      "compilation-config.pass_config.eliminate_noops: false\n"
                      "compilation_config.compile_sizes: [1, 2]\n"
                      "compilation_config.mode: 0\n")
    args = parse(["serve", "/m", "--config", str(config)])
    assert args.model_tag == "/m"
    assert args.compilation_config == {"mode": 0, "compile_sizes": [1, 2], "pass_config": {
        "fuse_norm_quant": True, "eliminate_noops": False}}


def test_a_text_flag_takes_the_text_as_written(tmp_path):
    """YAML 1.1 reads 0777 as 511, 1.10 as 1.1 and no as false: `api-key: 0777` gave a server
    whose key was 511 (every request a 401), `served-model-name: [1.10, no]` a model named 1.1
    and `--served-model-name` with no value. A number flag keeps YAML's reading (.inf)."""
    config = tmp_path / "c.yaml"
    config.write_text("api-key: 0777\nserved-model-name: [1.10, no]\nmax-model-len: 0x40\n")
    args = parse(["serve", "/m", "--config", str(config)])
    assert (args.api_key, args.served_model_name, args.max_model_len) == (
        "0777", ["1.10", "no"], 64)
    config.write_text("request-rate: .inf\nnum-prompts: 2\n")
    args = parse(["bench", "serve", "--config", str(config)])
    assert args.request_rate == float("inf") and args.num_prompts == 2


def test_after_a_bare_double_dash_everything_is_positional(tmp_path):
    """`kiln generate -- -O3` asks for the prompt "-O3" (argparse's reading of "--"): it became
    "--optimization-level=3", and a prompt "--config" was taken for the flag."""
    assert parse(["generate", "--max-tokens", "3", "--", "-O3"]).prompt == "-O3"
    assert parse(["generate", "--", "--config"]).prompt == "--config"
    config = tmp_path / "c.yaml"
    config.write_text("max-tokens: 4\n")
    args = parse(["generate", "--config", str(config), "--", "--max_tokens"])
    assert (args.prompt, args.max_tokens) == ("--max_tokens", 4)
