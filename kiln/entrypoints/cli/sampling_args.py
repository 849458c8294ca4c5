"""Sampling flags shared by `kiln generate` and `kiln chat`, and the SamplingParams they build.

A flag left out takes the model's sampling default (its generation_config.json, or the one
--generation-config names), as a request to LLM.generate without SamplingParams does; where the
model has none, SamplingParams' own default (max tokens: the command's). `--seed` is the
engine's flag; it also seeds sampling so a CLI run is reproducible.
"""
import argparse

from kiln.config.generation_defaults import GENERATION_CONFIG_KEYS
from kiln.sampling_params import SamplingParams

_MODEL_DEFAULT = "the model's generation config, else "

# flag -> (type, SamplingParams field, what it does); a default not from the model's generation
# config is SamplingParams'.
_FLAGS = {
    "--temperature": (float, "temperature", "sampling temperature; 0 means greedy"),
    "--top-p": (float, "top_p", "sample from the smallest set of tokens whose probabilities add "
                "up to this (1: all)"),
    "--top-k": (int, "top_k", "sample from the K most likely tokens (0 or -1: all)"),
    "--min-p": (float, "min_p", "drop tokens less likely than this times the most likely one's "
                "probability (0: none)"),
    "--min-tokens": (int, "min_tokens", "tokens to generate before EOS or a stop string may end "
                     "the output"),
    "--repetition-penalty": (float, "repetition_penalty", "penalize tokens already in the "
                             "prompt or output: their logits divided by this (multiplied where "
                             "negative; 1: off)"),
    "--presence-penalty": (float, "presence_penalty", "subtract this from the logits of tokens "
                           "already generated (0: off)"),
    "--frequency-penalty": (float, "frequency_penalty", "subtract this times its count so far "
                            "from each generated token's logit (0: off)"),
}
_SAMPLING_DEFAULTS = SamplingParams()


def add_sampling_args(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    """`max_tokens`: the command's --max-tokens where the model's generation config sets no
    max_new_tokens."""
    g = parser.add_argument_group(
        "sampling", "a flag left out takes the model's default where its "
                    "generation_config.json (or --generation-config's) sets one, else the one "
                    "shown")
    for flag, (kind, field, text) in _FLAGS.items():
        # only some fields come from a generation config (vLLM's list)
        model = _MODEL_DEFAULT if field in GENERATION_CONFIG_KEYS.values() else ""
        g.add_argument(flag, type=kind, default=None,
                       help=f"{text} (default: {model}{getattr(_SAMPLING_DEFAULTS, field)})")
    g.add_argument("--max-tokens", type=int, default=None,
                   help=f"most tokens to generate (default: {_MODEL_DEFAULT}{max_tokens})")
    g.add_argument("--stop", action="append", default=None,
                   help="stop string (repeat for several)")
    g.add_argument("--ignore-eos", action="store_true",
                   help="keep generating past the end-of-sequence token")
    parser.set_defaults(fallback_max_tokens=max_tokens)


def sampling_params_from_args(args: argparse.Namespace, model_defaults: dict | None = None,
                              **overrides) -> SamplingParams:
    """The flags given, over `model_defaults` (SamplingParams field -> value, the model's
    generation config: ModelConfig.generation_defaults), over SamplingParams' defaults and the
    command's max tokens. Without `model_defaults`, it checks the flags before a model loads."""
    fields = {"max_tokens": args.fallback_max_tokens, **(model_defaults or {})}
    given = {field: getattr(args, field) for _, field, _ in _FLAGS.values()}
    given["max_tokens"] = args.max_tokens
    fields.update({k: v for k, v in given.items() if v is not None})
    fields.update(stop=args.stop, ignore_eos=args.ignore_eos, seed=args.seed)
    fields.update(overrides)
    return SamplingParams(**fields)
