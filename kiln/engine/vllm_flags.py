"""vLLM's engine and server flags that Kiln has no counterpart for: one table, each with why and
what to do instead, so `kiln serve --api-server-count 4` and `LLM(model_impl="vllm")` say so by
name rather than failing as an unknown argument.

A few take the value that has Kiln's one meaning (`-dpr 0`, `--model-impl auto`) and
ignore it, as EngineArgs does with --swap-space; any other value is refused with the reason.
"""
import argparse
import re
from dataclasses import dataclass
from decimal import Decimal

_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def human_readable_int(text: str) -> int:
    """An integer as vLLM's flags take it (--max-model-len 32k): a lowercase suffix is decimal
    (1k = 1000, 25.6k = 25600), an uppercase one binary (1K = 1024, whole numbers only)."""
    text = str(text).strip()
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgtKMGT])", text)
    if match is None:
        try:
            return int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"invalid int value: {text!r} (give an integer, or one with vLLM's suffixes: "
                "1k = 1000, 1K = 1024, 2m, 2M, ...)") from None
    number, suffix = match.groups()
    if suffix in _DECIMAL:
        return int(Decimal(number) * _DECIMAL[suffix])
    if "." in number:
        raise argparse.ArgumentTypeError(
            f"invalid int value: {text!r}: a binary suffix ({suffix}) takes a whole number; "
            f"{number}{suffix.lower()} is decimal")
    return int(number) * _BINARY[suffix]


def max_model_len_flag(text: str) -> int:
    """--max-model-len as vLLM takes it: human_readable_int, or -1 / auto (vLLM's auto-fit:
    the model's length lowered to what the KV cache holds); "auto" was refused as no int."""
    text = str(text).strip()
    return -1 if text.lower() == "auto" else human_readable_int(text)


@dataclass(frozen=True)
class VllmFlag:
    flags: tuple[str, ...]  # the long flag first: its keyword is LLM(...)'s argument
    what: str  # "{flag} is vLLM's flag for {what}"
    instead: str  # why Kiln has none, and what to use
    takes_value: bool = True  # False: a switch (nargs 0)
    accepted: tuple[str, ...] = ()  # values with Kiln's one meaning, taken and ignored
    accepted_alone: bool = False  # a value-less flag whose meaning Kiln always has
    # sizes a feature another flag of the table refuses: any value asks for nothing here
    any_value: bool = False

    @property
    def keyword(self) -> str:
        return self.flags[0].lstrip("-").replace("-", "_")

    def message(self, name: str, kind: str = "flag") -> str:
        text = f"{name} is vLLM's {kind} for {self.what}; {self.instead}"
        if self.accepted:
            taken = " or ".join(self.accepted)
            text += (f" (only {name.split('=')[0]}={taken} is taken)" if kind == "argument"
                     else f" (only {name} {taken} is taken)")
        return text


_ONE_NODE = ("Kiln's data-parallel replicas all run on this machine (-dp N); for more machines "
             "run one kiln serve per machine behind a load balancer")
_EXTERNAL_LB = ("Kiln's server balances its replicas itself (-dp N, by load); for an external "
                "balancer run one kiln serve per replica")

VLLM_ONLY_FLAGS: tuple[VllmFlag, ...] = (
    VllmFlag(("--max-num-partial-prefills",), "how many prompts may be prefilled in chunks at "
             "once", "Kiln's scheduler has no such limit; --max-num-batched-tokens bounds the "
             "prefill tokens of a step"),
    VllmFlag(("--override-generation-config",), "sampling defaults given as JSON",
             "give --generation-config DIR, a directory holding a generation_config.json with "
             "those fields"),
    VllmFlag(("--response-role",), "the role of chat answers", "Kiln answers as 'assistant'",
             accepted=("assistant",)),
    VllmFlag(("--limit-mm-per-prompt",), "multimodal inputs per prompt", "Kiln serves "
             "text-only models"),
    VllmFlag(("--mm-processor-kwargs",), "arguments of the multimodal processor", "Kiln "
             "serves text-only models"),
    VllmFlag(("--allowed-local-media-path",), "media files a prompt may name on this machine",
             "Kiln serves text-only models"),
    # vLLM removed both (vllm-project/vllm#28006) in favour of --hf-overrides
    VllmFlag(("--rope-scaling",), "overriding the model's RoPE scaling (removed from vLLM)",
             "give it as vLLM now does: --hf-overrides '{\"rope_scaling\": {\"rope_type\": "
             "\"linear\", \"factor\": 2.0}}'"),
    VllmFlag(("--rope-theta",), "overriding the model's RoPE theta (removed from vLLM)",
             "give it as vLLM now does: --hf-overrides '{\"rope_theta\": 1000000}'"),
    # -dp N runs N replicas on this machine behind the server's own balancer (dp_core_client.py)
    VllmFlag(("--data-parallel-address", "-dpa"), "the head node of a multi-node data-parallel "
             "deployment", _ONE_NODE),
    VllmFlag(("--data-parallel-rpc-port", "-dpp"), "the head node's port of a multi-node "
             "data-parallel deployment", _ONE_NODE),
    VllmFlag(("--data-parallel-start-rank", "-dpr"), "the first replica a node of a multi-node "
             "data-parallel deployment runs", _ONE_NODE, accepted=("0",)),
    VllmFlag(("--data-parallel-rank", "-dpn"), "the one replica an externally balanced server "
             "runs", _EXTERNAL_LB),
    VllmFlag(("--data-parallel-hybrid-lb", "-dph"), "balancing replicas per node behind an "
             "external balancer", _EXTERNAL_LB, takes_value=False),
    VllmFlag(("--data-parallel-external-lb", "-dpe"), "leaving data-parallel balancing to an "
             "external balancer", _EXTERNAL_LB, takes_value=False),
    VllmFlag(("--data-parallel-multi-port-external-lb",), "one port per replica behind an "
             "external balancer", _EXTERNAL_LB, takes_value=False),
    VllmFlag(("--api-server-count",), "several API server processes", "kiln serve runs one",
             accepted=("1",)),
    VllmFlag(("--max-seq-len-to-capture",), "the longest sequence CUDA graphs cover",
             "Kiln's CUDA graphs are sized by batch: -O '{\"cudagraph_capture_sizes\": [...]}' "
             "or -O.max_cudagraph_capture_size=N"),
    VllmFlag(("--disable-custom-all-reduce",), "using NCCL's all-reduce instead of vLLM's own "
             "kernel", "Kiln's all-reduce is torch.distributed's (NCCL, gloo) already",
             takes_value=False, accepted_alone=True),
    VllmFlag(("--logprobs-mode",), "choosing what logprobs hold (raw or processed logprobs "
             "or logits)", "Kiln's logprobs and prompt_logprobs are always the model's raw "
             "log-probabilities, before penalties, temperature and top-k/top-p/min-p (vLLM's "
             "default)", accepted=("raw_logprobs",)),
    VllmFlag(("--enable-log-requests",), "logging request contents", "Kiln never logs them "
             "(its access log has one line per HTTP request; --disable-access-log drops it)",
             takes_value=False),
    VllmFlag(("--chat-template-content-format",), "how message content reaches the chat "
             "template", "Kiln joins the text parts into a string", accepted=("auto", "string")),
    VllmFlag(("--async-scheduling",), "scheduling the next step while the GPU runs this one",
             "Kiln schedules each step before it runs", takes_value=False),
    VllmFlag(("--cpu-offload-gb",), "keeping part of the weights in CPU memory", "Kiln holds "
             "all weights on the device: use a smaller dtype, --quantization or -tp / -pp",
             accepted=("0",)),
    VllmFlag(("--model-impl",), "choosing vLLM's or transformers' model code", "Kiln runs its "
             "own for every architecture it serves (kiln/model/registry.py)",
             accepted=("auto",)),
    VllmFlag(("--enable-expert-parallel",), "placing whole experts of a mixture of experts on "
             "each rank", "Kiln splits every expert's intermediate dimension over the "
             "--tensor-parallel-size ranks instead (vLLM's default without the flag)",
             takes_value=False),
    VllmFlag(("--enable-server-load-tracking",), "counting requests in flight for GET /load",
             "Kiln always counts them", takes_value=False, accepted_alone=True),
    VllmFlag(("--prefix-caching-hash-algo",), "choosing the hash of prefix-cache blocks",
             "Kiln hashes each block (chained with its prefix) with SHA-256, vLLM's default, "
             "and publishes no block hashes (no KV events)", accepted=("sha256",)),
    VllmFlag(("--kv-cache-memory-bytes",), "the KV cache size in bytes", "Kiln's "
             "--kv-cache-memory takes GiB (e.g. --kv-cache-memory 4)"),
    # vLLM serve flags seen in deployment scripts, which were a bare "unrecognized argument"
    VllmFlag(("--enable-log-outputs",), "logging generated outputs", "Kiln never logs them "
             "(its access log has one line per HTTP request)", takes_value=False),
    VllmFlag(("--hf-token",), "the Hugging Face token for downloads", "set the HF_TOKEN "
             "environment variable instead (huggingface_hub reads it)"),
    VllmFlag(("--guided-decoding-backend",), "the structured-output backend (its older name)",
             "Kiln compiles grammars with xgrammar", accepted=("xgrammar", "auto")),
    VllmFlag(("--long-prefill-token-threshold",), "which prompts count as long for partial "
             "prefills", "Kiln's scheduler has no such limit; --max-num-batched-tokens bounds "
             "the prefill tokens of a step", accepted=("0",)),
    VllmFlag(("--otlp-traces-endpoint",), "exporting OpenTelemetry traces", "Kiln exports "
             "none: scrape GET /metrics (Prometheus)"),
    VllmFlag(("--calculate-kv-scales",), "fp8 KV-cache scales computed from the first batch",
             "Kiln's fp8 KV cache (--kv-cache-dtype fp8) reads the checkpoint's k/v scales where "
             "it has them and otherwise keeps scales of 1.0, vLLM's default without this flag: "
             "drop it", takes_value=False),
    VllmFlag(("--uds",), "serving on a Unix domain socket", "kiln serve listens on TCP "
             "(--host, --port): put a proxy on the socket"),
)

_JSON_OUT = ("Kiln's benchmarks print their result as one JSON line on stdout: redirect it "
             "(> result.json)")
_RANDOM = "Kiln's benchmarks draw seeded random-token prompts of --input-len tokens"

# `vllm bench` flags for what `kiln bench` does another way.
VLLM_BENCH_FLAGS: tuple[VllmFlag, ...] = (
    VllmFlag(("--dataset-name",), "choosing the prompt dataset", _RANDOM, accepted=("random",)),
    VllmFlag(("--dataset-path",), "a file of prompts", _RANDOM),
    VllmFlag(("--random-range-ratio",), "spreading the random prompts' lengths", "Kiln's "
             "random prompts all have --input-len tokens", accepted=("0", "0.0")),
    VllmFlag(("--save-result",), "writing the result to a file", _JSON_OUT, takes_value=False),
    VllmFlag(("--result-dir",), "where the result file goes", _JSON_OUT),
    VllmFlag(("--result-filename",), "the result file's name", _JSON_OUT),
    VllmFlag(("--output-json",), "writing the result to a JSON file", _JSON_OUT),
)

BY_FLAG: dict[str, VllmFlag] = {name: entry for entry in VLLM_ONLY_FLAGS for name in entry.flags}
BY_KEYWORD: dict[str, VllmFlag] = {entry.keyword: entry for entry in VLLM_ONLY_FLAGS}


class VllmOnlyFlagError(ValueError):
    """A vLLM flag or argument Kiln has no counterpart for (the message says why)."""


class _RefuseVllmFlag(argparse.Action):
    """Takes the flag's Kiln meaning (accepted values) silently; refuses anything else."""

    def __init__(self, option_strings, dest, entry: VllmFlag, **kwargs):
        self.entry = entry
        # a switch takes no value: `--enable-log-outputs MODEL` must not swallow the model
        super().__init__(option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS,
                         nargs="?" if entry.takes_value else 0, **kwargs)

    def __call__(self, parser, namespace, value, option_string=None):
        entry = self.entry
        value = value or None  # a switch (nargs 0) passes []
        if entry.any_value:
            return
        if value is None and entry.accepted_alone:
            return
        if value is not None and value in entry.accepted:
            return
        raise VllmOnlyFlagError(entry.message(option_string or entry.flags[0]))


def add_vllm_only_flags(parser: argparse.ArgumentParser,
                        table: tuple[VllmFlag, ...] = VLLM_ONLY_FLAGS) -> None:
    """Each table flag on `parser`, hidden from --help: refused with its reason when given."""
    existing = set(parser._option_string_actions)
    for entry in table:
        names = [f for f in entry.flags if f not in existing]
        if names:
            parser.add_argument(*names, action=_RefuseVllmFlag, entry=entry,
                                help=argparse.SUPPRESS)


def _asks_nothing(value) -> bool:
    return value is None or value is False or (isinstance(value, (dict, list, tuple, str))
                                                and len(value) == 0)


def check_vllm_only_kwargs(kwargs: dict) -> dict:
    """LLM(**kwargs): a table keyword is refused with its reason unless its value asks for
    nothing (None, False, {}) or has Kiln's one meaning; those are dropped. Returns the rest."""
    rest = {}
    for key, value in kwargs.items():
        entry = BY_KEYWORD.get(key)
        if entry is None:
            rest[key] = value
            continue
        if _asks_nothing(value) or entry.any_value:
            continue
        if value is True and entry.accepted_alone:
            continue
        if not isinstance(value, bool) and str(value) in entry.accepted:
            continue
        raise VllmOnlyFlagError(entry.message(f"{key}={value!r}", kind="argument"))
    return rest
