"""The `kiln` command run as a user would: a subprocess; stdout carries only results."""
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from kiln.entrypoints.cli.main import build_parser

from checkpoints import STORIES_DIR

ENGINE = ["--enforce-eager", "--kv-cache-memory", "0.02", "--max-model-len", "128"]


def kiln(*argv, stdin: str | bytes | None = None, timeout: int = 300,
         env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kiln.entrypoints.cli.main", *argv],
                          input=stdin, capture_output=True, text=not isinstance(stdin, bytes),
                          timeout=timeout, env=env)


def kilns(*runs: tuple) -> list[subprocess.CompletedProcess]:
    """`kiln ARGV` for each (argv, stdin) at once: a run is mostly one core's interpreter start
    and imports, and the suite's machine has two."""
    env = dict(os.environ)  # as now: a test may set its own process's variables meanwhile
    with ThreadPoolExecutor(len(runs)) as pool:
        return list(pool.map(lambda run: kiln(*run[0], stdin=run[1], env=env), runs))


def kiln_exits(*argv, stdin: str = "") -> tuple[int, str, str]:
    """`kiln ARGV` run by its main() in this process: (exit code, stdout, stderr with Kiln's
    log lines), for a command that ends before any engine is built (a usage error), or whose
    engine core runs in this process (bench throughput; KILN_ENABLE_V1_MULTIPROCESSING=0) where
    what it prints, not its process, is the subject: the same parser and error handling as the
    subprocess, without an interpreter's start."""
    import contextlib
    import io
    import logging
    import signal

    from kiln.entrypoints.cli import main as cli
    from kiln.logger import init_logger

    init_logger("kiln")  # its handler stays on the session's stderr, not on this one
    out, err = io.StringIO(), io.StringIO()
    logs = logging.StreamHandler(err)
    saved = (signal.getsignal(signal.SIGTERM), sys.unraisablehook, cli._prestart_core,
             cli.exit_without_teardown, sys.stdin)
    logging.getLogger("kiln").addHandler(logs)
    cli._prestart_core = lambda argv: None  # no core interpreter for a command that ends first
    cli.exit_without_teardown = sys.exit  # its os._exit would end pytest
    sys.stdin = io.StringIO(stdin)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            cli.main(list(argv))
        code = 0
    except SystemExit as e:
        code = e.code
    finally:
        logging.getLogger("kiln").removeHandler(logs)
        signal.signal(signal.SIGTERM, saved[0])
        sys.unraisablehook, cli._prestart_core, cli.exit_without_teardown, sys.stdin = saved[1:]
    return code, out.getvalue(), err.getvalue()


@pytest.fixture(scope="module")
def stories():
    return str(STORIES_DIR)


def test_subcommands_registered():
    parser = build_parser()
    args = parser.parse_args(["generate", "hi", "-O3", "--stop", "a", "--stop", "b", "--n", "2"])
    assert (args.prompt, args.compilation_config, args.stop, args.n) == ("hi", {"mode": 3}, ["a", "b"], 2)
    args = parser.parse_args(["bench", "throughput", "--num-prompts", "3", "-tp", "2"])
    assert (args.num_prompts, args.tensor_parallel_size, args.backend) == (3, 2, "kiln")


def test_generate_prints_only_text_and_a_piped_prompt_loses_its_last_newline(stories,
                                                                             monkeypatch):
    """`echo PROMPT | kiln generate` generated after the echo's newline (the stories tokenizer
    spells the newline): the piped prompt's text is the given one's."""
    from kiln.entrypoints.llm import LLM
    from kiln.sampling_params import SamplingParams

    argv = ["--model", stories, "--temperature", "0", "--max-tokens", "16", *ENGINE]
    with ThreadPoolExecutor(1) as pool:
        runs = pool.submit(kilns, (["generate", "Once upon a time", *argv], None),
                           (["generate", *argv], "Once upon a time\n"))
        monkeypatch.setenv("KILN_ENABLE_V1_MULTIPROCESSING", "0")  # the reference's core here
        llm = LLM(model=stories, enforce_eager=True, kv_cache_memory=0.02, max_model_len=128)
        (expected,) = llm.generate("Once upon a time",
                                   SamplingParams(temperature=0, max_tokens=16), use_tqdm=False)
        llm.shutdown()
        given, piped = runs.result()
    assert given.returncode == 0, given.stderr
    assert given.stdout == expected.outputs[0].text + "\n"
    assert "INFO" in given.stderr and "INFO" not in given.stdout
    assert piped.returncode == 0, piped.stderr
    assert piped.stdout == given.stdout


def test_generate_logprobs_go_to_stderr(stories):
    # one run for both: each row says which it is (a prompt row has its prompt_position)
    r = kiln("generate", "Tom went", "--model", stories, "--max-tokens", "3", "--logprobs", "2",
             "--prompt-logprobs", "1", *ENGINE)
    assert r.returncode == 0, r.stderr
    rows = [json.loads(line) for line in r.stderr.splitlines() if line.startswith("{")]
    sampled = [row for row in rows if "prompt_position" not in row]
    assert len(sampled) == 3 and all(len(row["top"]) >= 2 for row in sampled)
    prompt = [row for row in rows if "prompt_position" in row]
    assert len(prompt) >= 2 and prompt[0]["top"] is None
    for row in prompt[1:]:
        assert str(row["token_id"]) in row["top"] and len(row["top"]) <= 2


@pytest.mark.parametrize("argv,message", [
    (["--model", "/no/such/model"], "no such file"),
    (["-O", "{bad"], "--compilation-config"),
    (["--max-model-len", "100000"], "--max-model-len"),
])
def test_user_errors_exit_2_without_traceback(stories, argv, message):
    argv = argv if argv[0] == "--model" else ["--model", stories, *argv]
    code, out, err = kiln_exits("generate", "hi", *argv)
    assert code == 2
    # ours say "error: ...", argparse's "kiln generate: error: ..."
    errors = [line for line in err.splitlines() if "error: " in line]
    assert len(errors) == 1 and message in errors[0]
    assert "Traceback" not in err and out == ""


@pytest.mark.parametrize("argv", [["generate", "hi"], ["chat", "--quick", "hi"]])
def test_skip_tokenizer_init_is_refused_before_the_model_loads(argv):
    """generate and chat take text: with --skip-tokenizer-init they loaded the model, then
    generate asked for {'prompt_token_ids': [...]}, which the command cannot take (helper-80)."""
    args = build_parser().parse_args([*argv, "--model", "/no/such/model",
                                      "--skip-tokenizer-init"])
    with pytest.raises(ValueError, match="drop --skip-tokenizer-init"):
        args.func(args)

def test_a_non_utf8_generate_prompt_is_refused_before_the_model_loads():
    """Bytes that are not UTF-8 (an argument, a file on stdin) reach Python as lone surrogates:
    the model loaded, then "prompt 0: prompt contains a lone UTF-16 surrogate ('\\udcff')"."""
    args = build_parser().parse_args(["generate", "ab\udcffc", "--model", "/no/such/model"])
    with pytest.raises(ValueError, match=r"not UTF-8 text \(byte 0xff at character 2\)"):
        args.func(args)


@pytest.mark.parametrize("flags", [["--system", "s\udce9"], ["--quick", "q\udce9"]])
def test_a_non_utf8_chat_flag_is_refused_before_the_model_loads(flags):
    """--system's lone surrogates failed every turn after the model loaded, blamed on
    'messages'."""
    args = build_parser().parse_args(["chat", *flags, "--model", "/no/such/model"])
    with pytest.raises(ValueError, match=rf"^{flags[0]} is not UTF-8 text \(byte 0xe9"):
        args.func(args)


def test_chat_streams_and_keeps_history_and_says_when_a_reply_is_empty(stories):
    """History: one reply per turn, none after "exit". Empty: every character a stop string,
    each reply ends before its first, and the user is told so rather than shown a bare blank
    line."""
    template = "{% for m in messages %}[{{ m.role }}] {{ m.content }} {% endfor %}"
    chat = ["chat", "--model", stories, "--temperature", "0", "--max-tokens", "6",
            "--chat-template", template, *ENGINE]
    stops = [a for c in " .,!?'\"0123456789abcdefghijklmnopqrstuvwxyz" for a in ("--stop", c)]
    stops += [a for c in "ABCDEFGHIJKLMNOPQRSTUVWXYZ\n" for a in ("--stop", c)]
    history, empty = kilns((chat, "Lily saw a\nThen\nexit\nignored\n"),
                           ([*chat, *stops], "Lily saw a\nexit\n"))
    assert history.returncode == 0, history.stderr
    assert len(history.stdout.splitlines()) == 2  # one reply per turn, none after "exit"
    assert empty.returncode == 0, empty.stderr
    assert empty.stdout.strip() == "" and "(empty reply" in empty.stderr


def test_chat_without_template_is_a_user_error_before_the_model_loads(stories, monkeypatch):
    from kiln.engine.llm_engine import LLMEngine

    built = []  # the tokenizer alone says there is no template: no engine is built for it
    monkeypatch.setattr(LLMEngine, "from_engine_args",
                        classmethod(lambda cls, *a, **k: built.append(1) or 1 / 0))
    code, _, err = kiln_exits("chat", "--model", stories, *ENGINE, stdin="Hi\n")
    assert code == 2 and "chat template" in err and "Traceback" not in err and not built


def test_chat_template_file_bad_flags_and_a_non_utf8_turn(tiny_llama_dir, tmp_path):
    """--chat-template takes a file, as vLLM's does; a broken template or a bad sampling flag
    is a usage error before any turn, not a traceback or an error per turn. A chat line that is
    not UTF-8 was reported at an offset into the rendered template, with a needless /reset."""
    template = tmp_path / "chat.jinja"
    template.write_text("{% for m in messages %}{{ m.content }} {% endfor %}")
    model = ["--model", str(tiny_llama_dir), *ENGINE]
    r = kiln("chat", *model, "--chat-template", str(template), "--temperature", "0",
             "--max-tokens", "3", stdin=b"w5 \xff\nw5 w6\nexit\n")
    err = r.stderr.decode()
    assert r.returncode == 0, err
    assert "not UTF-8 text (byte 0xff at character 3)" in err and "/reset" not in err, err
    assert len(r.stdout.splitlines()) == 1  # the next turn is answered
    for flags, message in ((["--chat-template", "{% for m in messages %}"],
                            "no valid Jinja template"),
                           (["--chat-template", str(tmp_path / "missing.jinja")], "no such file"),
                           (["--temperature", "-1"], "temperature (--temperature) must be")):
        code, _, err = kiln_exits("chat", *model, *flags, stdin="w5\n")
        assert code == 2, (flags, err)
        assert message in err and "Traceback" not in err, err


def test_bench_throughput_dummy_with_hf(stories):
    r = kiln("bench", "throughput", "--model", stories, "--load-format", "dummy",
             "--num-prompts", "4", "--input-len", "8", "--output-len", "4", "--backend", "hf",
             *ENGINE)
    assert r.returncode == 0, r.stderr
    (line,) = r.stdout.splitlines()
    report = json.loads(line)
    assert report["backend"] == "hf" and report["num_prompts"] == 4
    assert report["engine_core"] == "in-process"
    assert report["num_output_tokens"] == report["hf_num_output_tokens"] == 16
    for key in ("elapsed_s", "requests_per_s", "output_tokens_per_s", "total_tokens_per_s",
                "hf_output_tokens_per_s", "kiln_vs_hf_output_tokens_per_s"):
        assert report[key] > 0


def test_bench_throughput_int8_against_unquantized_in_one_run(stories):
    # Its report, not its process, is the subject (the core is in-process as in the command).
    code, out, err = kiln_exits("bench", "throughput", "--model", stories, "--num-prompts", "2",
                                "--input-len", "8", "--output-len", "3", "--quantization", "int8",
                                "--compare-unquantized", *ENGINE)
    assert code == 0, err
    report = json.loads(out)
    assert report["quantization"] == "int8" and report["dtype"] == "float32"
    assert report["quantization_rotation"] == "hadamard"  # auto, resolved: what ran
    # vLLM's bench throughput's sampling, for both engines; --seed's default
    assert (report["temperature"], report["top_p"], report["seed"]) == (1.0, 1.0, 0)
    assert report["num_output_tokens"] == 6 and report["unquantized_output_tokens_per_s"] > 0
    ratio = report["output_tokens_per_s"] / report["unquantized_output_tokens_per_s"]
    assert abs(report["speedup_vs_unquantized"] / ratio - 1) < 1e-3  # from unrounded figures
    # int8 weights (plus per-channel scales) against float32 ones; embeddings stay float32
    assert 0.2 < report["weight_bytes_vs_unquantized"] < 1
    assert report["model_weight_bytes"] < report["unquantized_model_weight_bytes"]
    code, _, err = kiln_exits("bench", "throughput", "--model", stories, "--compare-unquantized",
                              *ENGINE)
    assert code == 2 and "--compare-unquantized needs --quantization" in err


def test_bench_throughput_alternated_rounds(stories):
    """--rounds: both engines built first, then alternated rounds on fresh prompts; the median
    round's figures and every round's listed."""
    # Its report, not its process, is the subject (the core is in-process as in the command).
    code, out, err = kiln_exits("bench", "throughput", "--model", stories, "--num-prompts", "2",
                                "--input-len", "8", "--output-len", "3", "--quantization", "int8",
                                "--compare-unquantized", "--rounds", "3", *ENGINE)
    assert code == 0, err
    report = json.loads(out)
    assert report["rounds"] == 3 and report["num_output_tokens"] == 6
    speedups = report["round_speedups"]
    assert len(speedups) == len(report["round_output_tokens_per_s"]) == 3
    assert report["speedup_vs_unquantized"] == sorted(speedups)[1] or abs(
        report["speedup_vs_unquantized"] / sorted(speedups)[1] - 1) < 1e-3  # unrounded median
    assert 0.2 < report["weight_bytes_vs_unquantized"] < 1
    code, _, err = kiln_exits("bench", "throughput", "--model", stories, "--rounds", "2", *ENGINE)
    assert code == 2 and "--rounds 2" in err
    code, _, err = kiln_exits("bench", "throughput", "--model", stories, "--quantization", "int8",
                              "--compare-unquantized", "--rounds", "2", "--backend", "hf",
                              *ENGINE)
    assert code == 2 and "the kiln backend" in err


def test_bench_throughput_with_the_core_in_its_own_process(stories):
    r = kiln("bench", "throughput", "--model", stories, "--num-prompts", "2", "--input-len", "8",
             "--output-len", "3", "--multiprocess", *ENGINE)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    assert report["engine_core"] == "own process" and report["num_output_tokens"] == 6
    assert report["output_tokens_per_s"] > 0 and report["model_weight_bytes"] is None


def test_an_engine_in_the_commands_process_waits_as_the_cores_openmp_threads():
    """`kiln` sets the core's OpenMP wait (core_interpreter.set_openmp_wait) in its own process
    before torch loads libgomp, which reads it once: an in-process engine (bench throughput's
    default) then spins as LLM's core does, not libgomp's ~5-8 ms after every region. libgomp
    says what it read (OMP_DISPLAY_ENV); a user's spin count or wait policy stays."""
    from kiln.engine.core_interpreter import CORE_SPIN_COUNT

    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    env["OMP_DISPLAY_ENV"] = "VERBOSE"
    with ThreadPoolExecutor(3) as pool:  # each run is mostly its interpreter importing torch
        runs = list(pool.map(
            lambda extra: kiln("bench", "throughput", "--help", env={**env, **extra}, timeout=120),
            ({}, {"GOMP_SPINCOUNT": "7"}, {"OMP_WAIT_POLICY": "PASSIVE"})))
    for r in runs:
        assert r.returncode == 0, r.stderr
    ours, users_count, users_policy = (r.stderr for r in runs)
    assert f"GOMP_SPINCOUNT = '{CORE_SPIN_COUNT}'" in ours, ours
    assert "GOMP_SPINCOUNT = '7'" in users_count
    assert "GOMP_SPINCOUNT = '0'" in users_policy  # libgomp's own count for PASSIVE


def test_bench_rejects_lengths_over_max_model_len(stories, monkeypatch):
    from kiln.engine.llm_engine import LLMEngine

    code, _, err = kiln_exits("bench", "throughput", "--model", stories, "--input-len", "100",
                              "--output-len", "100", *ENGINE)
    assert code == 2 and "--max-model-len" in err
    # A KV cache too small for the lengths caps max_model_len: a larger cache is the fix, and
    # no report counts fewer output tokens than asked for. The engine built before the lengths
    # were known is shut down (it was left running).
    shutdowns = []
    real_shutdown = LLMEngine.shutdown
    monkeypatch.setattr(LLMEngine, "shutdown",
                        lambda self: shutdowns.append(1) or real_shutdown(self))
    code, out, err = kiln_exits("bench", "throughput", "--model", stories, "--input-len", "20",
                                "--output-len", "30", "--enforce-eager", "--kv-cache-memory",
                                "0.00004")  # 32 tokens
    assert code == 2 and "raise --kv-cache-memory" in err, err
    assert "Traceback" not in err and not out and shutdowns


def test_bench_compares_only_what_is_quantized_on_load(stories, tmp_path):
    from w8a8_checkpoint import write_w8a8_checkpoint

    ckpt = write_w8a8_checkpoint(Path(stories), tmp_path / "w8a8")
    code, _, err = kiln_exits("bench", "throughput", "--model", str(ckpt), "--quantization",
                              "compressed-tensors", "--compare-unquantized", *ENGINE)
    assert code == 2 and "no float weights to compare" in err, err


def _all_parsers(parser, prog="kiln"):
    import argparse

    yield prog, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _all_parsers(sub, f"{prog} {name}")


def test_every_flag_has_help_and_shows_its_default():
    """--help said nothing of --port, --dtype, --seed, --top-p, ... nor of any default."""
    import argparse

    missing = [f"{prog} {action.option_strings[0]}" for prog, parser in _all_parsers(build_parser())
               for action in parser._actions
               if action.option_strings and not action.help]
    assert missing == []
    serve = dict(_all_parsers(build_parser()))["kiln serve"]
    text = " ".join(serve.format_help().split())  # unwrapped
    for shown in ("(default: 8000)", "(default: info)", "(default: 0.9)", "(default: 16)",
                  "(default: auto)"):
        assert shown in text, shown
    assert "(default: None)" not in text and "(default: False)" not in text
    # -O says what each mode is
    assert "0: eager" in text and "3: Kiln's piecewise stack" in text
    latency = " ".join(dict(_all_parsers(build_parser()))["kiln bench latency"].format_help().split())
    assert "(default: 1 8 32)" in latency
    assert isinstance(serve._option_string_actions["--enable-prefix-caching"],
                      argparse.BooleanOptionalAction)
    assert "(default: True)" in text


def test_generate_takes_the_models_sampling_defaults(tiny_llama_dir, tmp_path, monkeypatch):
    """Flags left out take the model's generation_config.json (its own, or --generation-config
    DIR's), as LLM.generate does: the CLI passed temperature 1.0 and 128 tokens whatever the
    model said. Flags given still win. The flags, not the process, are the subject: run here."""
    import shutil

    monkeypatch.setenv("KILN_ENABLE_V1_MULTIPROCESSING", "0")

    model = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, model)
    (model / "generation_config.json").write_text(json.dumps({"temperature": 0,
                                                              "max_new_tokens": 3}))

    def tokens(*argv):
        code, out, err = kiln_exits("generate", "w5 w6", "--logprobs", "0", "--ignore-eos",
                                    *argv, *ENGINE)
        assert code == 0, err
        return out, sum(line.startswith('{"index"') for line in err.splitlines())

    first = tokens("--model", str(model), "--seed", "1")
    assert first[1] == 3  # max_new_tokens
    assert tokens("--model", str(model), "--seed", "2") == first  # temperature 0
    # --generation-config DIR on a model without one; --max-tokens over its max_new_tokens
    assert tokens("--model", str(tiny_llama_dir), "--generation-config", str(model),
                  "--max-tokens", "2")[1] == 2


def test_an_engine_death_is_one_line_not_a_traceback():
    """kiln's main turns what engine_gone tells into one line and exit 1."""
    from kiln.engine.core_errors import EngineCoreDeadError, engine_gone
    from kiln.executor.rank_errors import WorkerFailedError

    assert engine_gone(EngineCoreDeadError("core died")) and engine_gone(WorkerFailedError("x"))
    assert not engine_gone(RuntimeError("a bug"))


def test_only_the_engines_death_and_a_piece_that_will_not_compile_end_in_one_line():
    """A piece's compile error is one line, also inside Dynamo's wrapper (a core in this
    process); Kiln's other RuntimeErrors mean a bug (a recompile after warm-up) and keep their
    traceback (one cut printed every Kiln RuntimeError as one line)."""
    from kiln.compilation.phase import RecompileAfterWarmupError
    from kiln.compilation.piecewise import PieceCompileError
    from kiln.engine.core_errors import EngineCoreDeadError
    from kiln.entrypoints.cli.main import one_line_error

    piece = PieceCompileError("compiling piece 0 (range) failed")

    class BackendCompilerFailed(RuntimeError):  # Dynamo's, by its name
        inner_exception = piece

    dead = EngineCoreDeadError("core died")
    assert one_line_error(dead) is dead and one_line_error(piece) is piece
    assert one_line_error(BackendCompilerFailed("wrapped")) is piece
    assert one_line_error(RecompileAfterWarmupError("recompiled")) is None
    assert one_line_error(RuntimeError("a bug")) is None


def test_a_piece_that_will_not_compile_ends_in_one_line_naming_it_and_the_way_out(
        tiny_llama_dir, tmp_path):
    """No working C++ compiler: the command ended in Dynamo's wrapper of Inductor's error
    (the backend object's address, "Set TORCHDYNAMO_VERBOSE=1", compiler output) with no word
    of the piece or of serving without compiling (helper-58). `kiln compile` and `kiln bench
    throughput` run the engine core in the command's own process, where Dynamo's
    BackendCompilerFailed wraps the PieceCompileError: they ended in that wrapper's traceback
    (helper-63). The three commands run at once, each on its own cache."""
    def config(name):
        return json.dumps({"mode": 3, "cache_dir": str(tmp_path / name),
                           "inductor_compile_config": {"cpp.cxx": [None, "/nonexistent/g++"]}})

    model = ["--model", str(tiny_llama_dir), "--max-model-len", "64"]
    generate, compiled, bench = kilns(
        (["generate", "hello", *model, "--max-tokens", "4", "--compilation-config",
          config("generate")], None),
        (["compile", *model, "--compilation-config", config("compile")], None),
        (["bench", "throughput", "--num-prompts", "1", "--input-len", "4", "--output-len", "2",
          *model, "--compilation-config", config("bench")], None))
    for r in (generate, compiled, bench):
        last = r.stderr.strip().splitlines()[-1]
        assert r.returncode == 1 and last.startswith("error: compiling piece 0 (range) failed ("), \
            r.stderr[-3000:]
    last = generate.stderr.strip().splitlines()[-1]
    assert "/nonexistent/g++" in last and last.endswith("--enforce-eager (-O0) serves the model "
                                                        "without compiling")
    for r in (compiled, bench):  # the traceback is still logged, as a core's is
        assert "engine core failed" in r.stderr
