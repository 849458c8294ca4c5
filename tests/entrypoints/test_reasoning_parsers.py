"""Reasoning split: <think>...</think> text goes to reasoning, the rest to content, the same
whether the answer comes whole or in deltas cut anywhere; the prompt tells whether the answer
starts inside the thinking (DeepSeek-R1 opens it in the template; Qwen3 with thinking off
closes an empty one)."""
import random

import pytest

from kiln.reasoning import grammar_thinking_first, grammar_waits_for_reasoning, make_splitter
from kiln.reasoning.think_splitter import ThinkSplitter, prompt_opens_thinking
from kiln.reasoning.token_count import ReasoningTokenCounter
from kiln.sampling_params import StructuredOutputsParams

CASES = [
    # (answer, starts inside, (reasoning, content))
    ("<think>\nplan it\n</think>\n\nAnswer.", False, ("\nplan it\n", "\n\nAnswer.")),
    ("  <think>a</think>b", False, ("a", "b")),
    ("no thinking at all", False, (None, "no thinking at all")),
    ("x </think> y", False, (None, "x </think> y")),
    ("<think>cut short", False, ("cut short", None)),
    ("steps</think>done", True, ("steps", "done")),
    ("<think>steps</think>done", True, ("steps", "done")),
    ("still thinking", True, ("still thinking", None)),
    ("<thi", False, (None, "<thi")),
]


@pytest.mark.parametrize("answer, inside, expected", CASES)
def test_whole_and_streamed_agree(answer, inside, expected):
    assert ThinkSplitter(inside).split(answer) == expected
    for seed in range(30):
        rng, splitter = random.Random(seed), ThinkSplitter(inside)
        reasoning = content = ""
        i = 0
        while i < len(answer):
            j = min(len(answer), i + rng.randint(1, 5))
            r, c = splitter.feed(answer[i:j])
            reasoning, content, i = reasoning + r, content + c, j
        r, c = splitter.feed("", final=True)
        assert (reasoning + r or None, content + c or None) == expected


def test_the_prompt_decides_where_an_answer_starts():
    assert prompt_opens_thinking("<|im_start|>assistant\n<think>\n") is True
    assert prompt_opens_thinking("assistant\n<think>\n\n</think>\n\n") is False
    assert prompt_opens_thinking("plain prompt") is None and prompt_opens_thinking(None) is None
    # Without a word from the prompt, deepseek_r1 starts inside and qwen3 outside.
    assert make_splitter("deepseek_r1", "user: hi").split("r</think>c") == ("r", "c")
    assert make_splitter("qwen3", "user: hi").split("r</think>c") == (None, "r</think>c")
    assert make_splitter("qwen3", "<think>\n").split("r</think>c") == ("r", "c")
    assert make_splitter("deepseek_r1", "<think></think>").split("c") == (None, "c")
    # Under a grammar the answer is shaped from its first token: no thinking comes first.
    assert make_splitter("deepseek_r1", "<think>\n", thinking_first=False).split('{"a": 1}') == \
        (None, '{"a": 1}')
    assert make_splitter("deepseek_r1", "x", thinking_first=False).split("<think>r</think>c") == \
        ("r", "c")


def test_a_grammar_waits_unless_the_prompt_closed_the_thinking():
    assert grammar_waits_for_reasoning("qwen3", "<|im_start|>assistant\n")
    assert grammar_waits_for_reasoning("deepseek_r1", "Assistant: <think>\n")
    assert not grammar_waits_for_reasoning("qwen3", "assistant\n<think>\n\n</think>\n\n")


def test_a_grammar_waiting_for_the_end_of_thinking_counts_all_before_it_as_thinking():
    """What the grammar left free (it waits for </think>) is thinking, even when the answer
    never writes </think>: it must not come back as content the grammar never shaped."""
    waits = StructuredOutputsParams(json={"type": "object"}, reasoning_end="</think>")
    assert grammar_thinking_first(waits) is True
    assert make_splitter("qwen3", "user: hi", True).split("cut short") == ("cut short", None)
    assert make_splitter("qwen3", "user: hi", True).split("<think>r</think>{}") == ("r", "{}")
    assert grammar_thinking_first(StructuredOutputsParams(json={"type": "object"})) is False
    assert grammar_thinking_first(None) is None
    # another marker than </think>: the splitter cannot follow it, the prompt decides
    other = StructuredOutputsParams(json={"type": "object"}, reasoning_end="[END]")
    assert grammar_thinking_first(other) is None


@pytest.mark.parametrize("ids, inside, expected", [
    ([1, 5, 5, 2, 5], False, 2),  # <think> a a </think> b
    ([5, 1, 5, 2], False, 0),  # a <think> only opens as the first token
    ([5, 5, 2, 5], True, 2),  # opened by the prompt
    ([1, 5, 2, 5], True, 1),  # ... and by the answer as well: one block
    ([1, 5, 1, 5], False, 3),  # never closed: all of it after the tag
    ([2, 5], False, 0),
])
def test_reasoning_tokens(ids, inside, expected):
    """usage's reasoning_tokens: the tokens the splitter gives reasoning, the tags not counted
    (ids: 1 <think>, 2 </think>), fed whole or token by token."""
    counter = ReasoningTokenCounter((1, 2), inside)
    counter.feed(ids)
    assert counter.count == expected
    counter = ReasoningTokenCounter((1, 2), inside)
    for token in ids:
        counter.feed([token])
    assert counter.count == expected


def test_usage_details_only_where_counted():
    """Without a reasoning parser (nothing counted) usage has no completion_tokens_details key,
    as vLLM's; with one, the count, 0 included."""
    from kiln.entrypoints.openai.response_models import make_usage

    assert "completion_tokens_details" not in make_usage(3, 4).model_dump()
    assert make_usage(3, 4, reasoning_tokens=0).model_dump()["completion_tokens_details"] == {
        "reasoning_tokens": 0}


@pytest.mark.parametrize("ids,inside", [
    ([9, 1, 5, 5, 2, 5], False),  # \n <think> a a </think> b: the splitter opens after whitespace
    ([9, 9, 1, 5, 2], True),  # opened by the prompt, and by the answer after whitespace
    ([9, 9, 5, 2, 5], True),  # whitespace inside the thinking is thinking
    ([9, 9], True),  # nothing but whitespace, still thinking
    ([9, 5, 1, 5], False),  # not at the start: no tag
    ([9, 2, 5], True),
    ([9], False),
])
def test_reasoning_tokens_after_leading_whitespace(ids, inside):
    """An answer opening with whitespace and then <think>: the splitter takes it as the opening
    tag, so its thinking's tokens count ("\\n<think>a</think>" counted 0 for reasoning "a").
    One character a token here, so the count is the length of the splitter's reasoning."""
    text = {1: "<think>", 2: "</think>", 5: "a", 9: "\n"}
    reasoning, _ = ThinkSplitter(inside).split("".join(text[i] for i in ids))
    for pieces in ([ids], [[i] for i in ids]):
        counter = ReasoningTokenCounter((1, 2), inside, lambda token: token == 9)
        for piece in pieces:
            counter.feed(piece)
        assert counter.count == len(reasoning or ""), pieces
