"""A chat template that fails while rendering is a ValueError naming the template, whatever the
template's own code raised, and one that renders nothing is refused as the template's fault:
LLM.chat raised ZeroDivisionError bare, and `kiln chat` died on it with a traceback."""
import io
import sys
from types import SimpleNamespace

import pytest

from kiln.engine.llm_engine import LLMEngine
from kiln.entrypoints.cli.main import build_parser

USER = [{"role": "user", "content": "w5"}]


@pytest.fixture
def engine(tokenizer):
    """Only what rendering reads: the tokenizer and the --chat-template flag."""
    e = LLMEngine.__new__(LLMEngine)
    e.tokenizer = tokenizer
    e.model_config = SimpleNamespace(chat_template=None, model="m")
    return e


@pytest.mark.parametrize("template, raised", [
    ("{{ 1/0 }}", "ZeroDivisionError"),
    ("{{ 1 + 'a' }}", "TypeError"),
    ("{{ messages[0]['content'] + messages[0]['nope'] }}", "UndefinedError"),
    ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "RecursionError"),
    ("{{ raise_exception('no users') }}", "TemplateError: no users"),
    # ValueErrors and assertions of the template's own code (a str method, a filter): bare,
    # they named nothing ("substring not found"), or were a traceback in kiln chat
    ("{{ 'abc'.index('z') }}", "ValueError: substring not found"),
    ("{{ messages[0]['content'].encode('ascii') }}{{ 'é'.encode('ascii') }}",
     "UnicodeEncodeError"),
    ("{{ 'x'|wordwrap(0) }}", "ValueError: invalid width 0"),
    ("{{ 'x'|truncate(-1) }}", "AssertionError"),
])
def test_a_template_failing_at_render_is_a_value_error(engine, template, raised):
    with pytest.raises(ValueError, match=f"chat template does not render: {raised}"):
        engine.chat_prompt(USER, chat_template=template)


def test_hf_own_value_errors_stay_as_they_are(engine):
    """continue_final_message's check runs after rendering, outside the template: its message
    names the fix, and is not blamed on the template."""
    template = "{% for m in messages %}<{{ m['role'] }}>{% endfor %}"
    with pytest.raises(ValueError, match="continue_final_message") as info:
        engine.chat_prompt(USER + [{"role": "assistant", "content": "zz"}],
                           add_generation_prompt=False, chat_template=template,
                           continue_final_message=True)
    assert "does not render" not in str(info.value)


def test_an_empty_render_blames_the_template_not_the_messages(engine):
    # {{ messages.__class__ }}: the sandbox hides the attribute, so it renders ""
    for template in ("{% if false %}x{% endif %}", "{{ messages.__class__ }}"):
        with pytest.raises(ValueError, match="chat template rendered an empty prompt"):
            engine.chat_prompt(USER, chat_template=template)


def test_kiln_chat_stops_on_a_template_error_in_one_line(tiny_llama_dir, monkeypatch):
    """The first turn's template error is a usage error (the CLI prints it in one line and
    exits 2), not a traceback; an empty render too, which used to fail every turn. (The engine
    core in this process: the template renders in the front end; `kiln chat` with a core
    process is test_chat_cli.py's.)"""
    monkeypatch.setenv("KILN_ENABLE_V1_MULTIPROCESSING", "0")
    for template in ("{{ 1/0 }}", "{% if false %}x{% endif %}"):
        monkeypatch.setattr(sys, "stdin", io.StringIO("w5\nw6\n"))
        args = build_parser().parse_args([
            "chat", "--model", str(tiny_llama_dir), "--chat-template", template,
            "--max-tokens", "2", "--enforce-eager", "--kv-cache-memory", "0.01"])
        with pytest.raises(ValueError, match="chat template"):
            args.func(args)
