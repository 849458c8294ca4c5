"""Sampling flags shared by `kiln generate` and `kiln chat`, and the SamplingParams they build.

`--seed` is the engine's flag; it also seeds sampling so a CLI run is reproducible.
"""
import argparse

from kiln.sampling_params import SamplingParams


def add_sampling_args(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--temperature", type=float, default=1.0, help="0 means greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="0 or -1: off")
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--max-tokens", type=int, default=max_tokens)
    g.add_argument("--min-tokens", type=int, default=0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--stop", action="append", default=None,
                   help="stop string (repeat for several)")
    g.add_argument("--ignore-eos", action="store_true")


def sampling_params_from_args(args: argparse.Namespace, **overrides) -> SamplingParams:
    fields = dict(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                  min_p=args.min_p, max_tokens=args.max_tokens, min_tokens=args.min_tokens,
                  repetition_penalty=args.repetition_penalty,
                  presence_penalty=args.presence_penalty,
                  frequency_penalty=args.frequency_penalty, stop=args.stop,
                  ignore_eos=args.ignore_eos, seed=args.seed)
    fields.update(overrides)
    return SamplingParams(**fields)
