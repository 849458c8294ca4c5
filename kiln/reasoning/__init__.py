"""Reasoning parsers (vLLM's --reasoning-parser): the text a thinking model writes between
<think> and </think> goes to reasoning_content, the rest to content."""
import dataclasses

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


def with_reasoning_end(name: str | None, constraint, prompt: str | None):
    """`constraint` (StructuredOutputsParams or None) as reasoning parser `name` runs it for an
    answer to `prompt`: waiting for </think> where grammar_waits_for_reasoning says so, unless
    it names its own end; unchanged otherwise (the same object)."""
    if (name is None or constraint is None or constraint.reasoning_end is not None
            or not grammar_waits_for_reasoning(name, prompt)):
        return constraint
    return dataclasses.replace(constraint, reasoning_end=END)


def make_splitter(name: str, prompt: str | None,
                  thinking_first: bool | None = None) -> ThinkSplitter:
    """A splitter for one answer to `prompt` (its rendered text, when known). `thinking_first`:
    how the answer's grammar reads its start, where it has one. False: the grammar shapes it
    from the first token, so no thinking comes first (a <think> the grammar itself allows at the
    start still opens one). True: the grammar waits for </think>, so all before it is thinking,
    even in an answer that never writes one (as vLLM's qwen3 parser reads it): what the grammar
    left free must not come back as content, nor as a forced call."""
    if thinking_first is not None:
        return ThinkSplitter(thinking_first)
    opened = prompt_opens_thinking(prompt)
    return ThinkSplitter(REASONING_PARSERS[name] if opened is None else opened)


def grammar_thinking_first(constraint) -> bool | None:
    """make_splitter's `thinking_first` for an answer under `constraint` (its structured
    outputs, or None): False where the grammar applies from the first token, True where it waits
    for </think>; None without one, or where it waits for another marker (the splitter knows
    only </think>): then the prompt and the parser decide."""
    if constraint is None:
        return None
    if constraint.reasoning_end is None:
        return False
    return True if constraint.reasoning_end == END else None


__all__ = ["END", "REASONING_PARSERS", "ThinkSplitter", "check_reasoning_parser",
           "grammar_waits_for_reasoning", "grammar_thinking_first", "make_splitter"]
