"""`kiln chat` in-process: each turn's prompt is the template over the whole history (token for
token as HF renders it), a history past max_model_len says how to go on, and /reset starts over."""
import io
import sys

import pytest

from kiln.engine.llm_engine import LLMEngine
from kiln.entrypoints.cli.main import build_parser


def test_history_parity_overflow_and_reset(tiny_llama_dir, monkeypatch, capsys):
    from transformers import AutoTokenizer

    seen, prompts = [], []
    render = LLMEngine.chat_prompt

    def spy(self, messages, *args, **kwargs):
        seen.append([dict(m) for m in messages])
        prompts.append(render(self, messages, *args, **kwargs))
        return prompts[-1]

    monkeypatch.setattr(LLMEngine, "chat_prompt", spy)
    turns = ["w5 w6 w7 w8 w9"] * 4 + ["/reset", "w10 w11"]
    monkeypatch.setattr(sys, "stdin", io.StringIO("\n".join(turns) + "\nexit\n"))
    args = build_parser().parse_args([
        "chat", "--model", str(tiny_llama_dir), "--system", "w3 w4", "--temperature", "0",
        "--max-tokens", "4", "--ignore-eos", "--enforce-eager", "--max-model-len", "30",
        "--kv-cache-memory", "0.01"])
    assert args.func(args) == 0
    out, err = capsys.readouterr()
    tok = AutoTokenizer.from_pretrained(tiny_llama_dir)
    replies = out.splitlines()
    system = {"role": "system", "content": "w3 w4"}
    user = {"role": "user", "content": "w5 w6 w7 w8 w9"}
    # Turns 1 and 2 fit (10, 21 tokens); turn 3 (32) passes max_model_len 30, so does turn 4
    # (the failed turn left no trace in the history); after /reset the conversation restarts.
    assert seen[0] == [system, user]
    assert seen[1] == [system, user, {"role": "assistant", "content": replies[0]}, user]
    assert seen[2] == seen[3] == seen[1] + [{"role": "assistant", "content": replies[1]}, user]
    assert seen[4] == [system, {"role": "user", "content": "w10 w11"}]
    assert len(seen) == 5 and len(replies) == 3 and all(replies)
    assert err.count("(/reset starts over)") == 2 and "conversation reset" in err
    for messages, prompt in zip(seen, prompts):
        assert prompt["prompt_token_ids"] == tok.apply_chat_template(
            messages, add_generation_prompt=True, return_dict=False)


def _spy_prompts(monkeypatch) -> list:
    seen = []
    render = LLMEngine.chat_prompt

    def spy(self, messages, *args, **kwargs):
        seen.append([dict(m) for m in messages])
        return render(self, messages, *args, **kwargs)

    monkeypatch.setattr(LLMEngine, "chat_prompt", spy)
    return seen


ENGINE_FLAGS = ["--temperature", "0", "--max-tokens", "2", "--ignore-eos", "--enforce-eager",
                "--kv-cache-memory", "0.01"]


def test_help_and_slash_exit_are_commands_not_turns(tiny_llama_dir, monkeypatch, capsys):
    """"/help" and "/exit" went to the model as user turns (and the chat went on)."""
    seen = _spy_prompts(monkeypatch)
    # CRLF line ends (a Windows file piped in): the turn is "w5", not "w5\r"
    monkeypatch.setattr(sys, "stdin", io.StringIO("/help\r\nw5\r\n/exit\r\nw6\n"))
    args = build_parser().parse_args(["chat", "--model", str(tiny_llama_dir), *ENGINE_FLAGS])
    assert args.func(args) == 0
    assert seen == [[{"role": "user", "content": "w5"}]]
    assert "/reset starts the conversation again" in capsys.readouterr().err


def test_vllm_chat_flags_system_prompt_and_quick(tiny_llama_dir, monkeypatch, capsys):
    """`vllm chat --system-prompt S --quick MESSAGE`: one turn, its reply printed, stdin unread."""
    seen = _spy_prompts(monkeypatch)
    monkeypatch.setattr(sys, "stdin", io.StringIO("w9\n"))
    args = build_parser().parse_args(["chat", "--model", str(tiny_llama_dir), *ENGINE_FLAGS,
                                      "--system-prompt", "w3 w4", "--quick", "w5 w6"])
    assert args.func(args) == 0
    assert seen == [[{"role": "system", "content": "w3 w4"},
                     {"role": "user", "content": "w5 w6"}]]
    assert len(capsys.readouterr().out.splitlines()) == 1


def test_an_empty_quick_message_is_refused_before_the_model_loads(monkeypatch):
    """`--quick ""` sent an empty user turn and printed the model's answer to it."""
    monkeypatch.setattr(LLMEngine, "from_engine_args",
                        lambda *a, **k: pytest.fail("the model loaded"))
    args = build_parser().parse_args(["chat", "--quick", " "])
    with pytest.raises(ValueError, match="--quick needs a message"):
        args.func(args)


def test_the_engine_config_is_built_once(tiny_llama_dir, monkeypatch):
    """The chat template check's config was built again by LLMEngine.from_engine_args: the
    model's config read and its max-model-len settled twice before the model loaded."""
    from kiln.engine.arg_utils import EngineArgs

    monkeypatch.setenv("KILN_ENABLE_V1_MULTIPROCESSING", "0")  # no core interpreter to start
    made, given = [], []
    create = EngineArgs.create_kiln_config
    monkeypatch.setattr(EngineArgs, "create_kiln_config",
                        lambda self: made.append(create(self)) or made[-1])

    def no_model(self, kiln_config, **kwargs):
        given.append(kiln_config)
        raise LookupError("no model loads in this test")
    monkeypatch.setattr(LLMEngine, "__init__", no_model)
    args = build_parser().parse_args(["chat", "--quick", "w5", "--model", str(tiny_llama_dir),
                                      *ENGINE_FLAGS])
    with pytest.raises(LookupError, match="no model loads"):
        args.func(args)
    assert len(made) == 1 and given == made
