"""--generation-config and --chat-template are checked when the engine is configured: before,
a bad default or an unparsable template was accepted and every request then failed on it
(helper-42)."""
import json

import pytest

from kiln.config.generation_defaults import load_chat_template, load_generation_defaults
from kiln.errors import ConfigError


def test_a_bad_default_in_the_users_file_is_refused_naming_the_file(tmp_path):
    for bad, field in (({"temperature": "hot"}, "temperature"),
                       ({"temperature": -1}, "temperature"), ({"max_new_tokens": 0}, "max_tokens")):
        (tmp_path / "generation_config.json").write_text(json.dumps(bad))
        with pytest.raises(ConfigError, match=rf"--generation-config .*generation_config.json: "
                                              rf"{field} must be"):
            load_generation_defaults(str(tmp_path), tmp_path)


def test_a_bad_default_in_the_models_own_file_is_dropped_with_a_warning(tmp_path, kiln_logs):
    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"temperature": -1, "top_p": 0.5}))
    assert load_generation_defaults("auto", tmp_path) == {"top_p": 0.5}
    assert "ignoring" in kiln_logs.text and "temperature must be" in kiln_logs.text


def test_a_chat_template_that_does_not_parse_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"--chat-template: the template text is no valid "
                                          r"Jinja template: .*'bad'.*\(line 1\)"):
        load_chat_template("{% bad")
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages }")
    with pytest.raises(ConfigError, match=f"--chat-template: {path} is no valid Jinja"):
        load_chat_template(str(path))
    good = "{% for m in messages %}{{ m['content'] }}{% break %}{% endfor %}"
    assert load_chat_template(good) == good
    # transformers' own tag (TRL's assistant masks), and text too long for a file name
    tracked = "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}" \
              "{% endfor %}"
    assert load_chat_template(tracked) == tracked
    long = "{# " + "x" * 5000 + " #}" + good
    assert load_chat_template(long) == long


def test_an_empty_chat_template_file_is_refused_at_start(tmp_path):
    """It rendered every chat as an empty prompt, each request failing on its own."""
    path = tmp_path / "empty.jinja"
    path.write_text("\n")
    with pytest.raises(ConfigError, match=f"--chat-template: {path} is empty"):
        load_chat_template(str(path))


def test_a_chat_template_that_is_not_utf8_is_refused_at_start(tmp_path):
    """A file: a bare "'utf-8' codec can't decode byte 0xff" named neither the flag nor the
    file. Text on the command line (bytes that are not UTF-8 become lone surrogates): every
    chat then failed to render, blamed on its messages."""
    path = tmp_path / "latin1.jinja"
    path.write_bytes("{{ 'café' }}{{ messages[0].content }}".encode("latin-1"))
    with pytest.raises(ConfigError, match=f"--chat-template: {path} is not UTF-8 text "
                                          r"\(invalid continuation byte at byte 7\)"):
        load_chat_template(str(path))
    with pytest.raises(ConfigError, match=r"--chat-template: the template text is not UTF-8 "
                                          r"text \('\\udce9' at character 7\)"):
        load_chat_template("{{ 'caf\udce9' }}{{ messages[0].content }}")
    path.write_text("{{ 'café\x00' }}", encoding="utf-8")
    assert load_chat_template(str(path)) == "{{ 'café\x00' }}"
