"""Reasoning parsers (vLLM's --reasoning-parser): the text a thinking model writes between
<think> and </think> goes to reasoning_content, the rest to content."""
from kiln.reasoning.think_splitter import ThinkSplitter, prompt_opens_thinking

# parser name -> whether an answer starts inside the thinking when nothing says otherwise:
# DeepSeek-R1's template opens <think> in the prompt; Qwen3 writes it itself (or, with
# enable_thinking=false, the template closes an empty one).
REASONING_PARSERS = {"qwen3": False, "deepseek_r1": True}


def check_reasoning_parser(name: str | None) -> None:
    if name is not None and name not in REASONING_PARSERS:
        raise ValueError(f"--reasoning-parser {name!r} is not one of {sorted(REASONING_PARSERS)}")


END = "</think>"


def grammar_waits_for_reasoning(name: str, prompt: str | None) -> bool:
    """Whether a constrained answer's grammar waits for </think> (vLLM's default with a
    reasoning parser): unless the prompt already closed the thinking (Qwen3 with
    enable_thinking=false), the model may think first, freely."""
    return name in REASONING_PARSERS and prompt_opens_thinking(prompt) is not False


def make_splitter(name: str, prompt: str | None, constrained: bool = False) -> ThinkSplitter:
    """A splitter for one answer to `prompt` (its rendered text, when known). `constrained`:
    a grammar shapes the answer from its first token, so it starts outside any thinking (a
    <think> the grammar itself allows at the start still opens one)."""
    if constrained:
        return ThinkSplitter(False)
    opened = prompt_opens_thinking(prompt)
    return ThinkSplitter(REASONING_PARSERS[name] if opened is None else opened)


__all__ = ["END", "REASONING_PARSERS", "ThinkSplitter", "check_reasoning_parser",
           "grammar_waits_for_reasoning", "make_splitter"]
