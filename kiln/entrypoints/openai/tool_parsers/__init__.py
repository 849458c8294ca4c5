"""Tool calling for /v1/chat/completions: which parser reads a request's answer (vLLM's
--tool-call-parser names), and what tool_choice asks of it (tool_plan.py)."""
from kiln.entrypoints.openai.tool_parsers.granite import GraniteToolParser
from kiln.entrypoints.openai.tool_parsers.hermes import HermesToolParser
from kiln.entrypoints.openai.tool_parsers.internlm import InternLMToolParser
from kiln.entrypoints.openai.tool_parsers.llama3_json import Llama3JsonToolParser
from kiln.entrypoints.openai.tool_parsers.mistral import MistralToolParser
from kiln.entrypoints.openai.tool_parsers.pythonic import PythonicToolParser
from kiln.entrypoints.openai.tool_parsers.qwen3_coder import Qwen3CoderToolParser

TOOL_PARSERS = {"granite": GraniteToolParser, "hermes": HermesToolParser,
                "internlm": InternLMToolParser, "llama3_json": Llama3JsonToolParser,
                "mistral": MistralToolParser, "pythonic": PythonicToolParser,
                "qwen3_coder": Qwen3CoderToolParser}


def check_tool_parser(name: str | None) -> None:
    if name is not None and name not in TOOL_PARSERS:
        raise ValueError(f"--tool-call-parser {name!r} is not one of {sorted(TOOL_PARSERS)}")
