"""`kiln generate "prompt"`: one completion (or n) printed to stdout; logs go to stderr.

With --logprobs N, each token's top-N logprobs go to stderr as JSON lines (stdout stays text only);
with --prompt-logprobs N, each prompt token's too (the first has none), before them.
"""
import argparse
import json
import sys

from kiln.engine.arg_utils import EngineArgs
from kiln.engine.text_encoding import not_utf8
from kiln.entrypoints.cli.sampling_args import add_sampling_args, sampling_params_from_args
from kiln.process_signals import exit_if_stopped


def register(subparsers) -> None:
    parser = subparsers.add_parser("generate", help="complete a prompt and print the text",
                                   description="Complete a prompt and print the text.")
    parser.add_argument("prompt", nargs="?", default=None,
                        help="the prompt text (default: read stdin)")
    add_sampling_args(parser, max_tokens=128)
    parser.add_argument("--n", type=int, default=1, help="completions to generate")
    parser.add_argument("--logprobs", type=int, default=None,
                        help="print the top-N logprobs of every token to stderr")
    parser.add_argument("--prompt-logprobs", type=int, default=None,
                        help="print each prompt token's logprob and the top-N to stderr")
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kiln.entrypoints.llm import LLM

    # Piped text ends in the newline of its last line, which is no part of the prompt (echo).
    prompt = args.prompt if args.prompt is not None else sys.stdin.read().removesuffix("\n")
    if not prompt:
        raise ValueError("prompt is empty: pass it as an argument or on stdin")
    if (problem := not_utf8(prompt)) is not None:  # said before the model loads
        raise ValueError(f"the prompt {problem}: pass UTF-8 text")
    extra = dict(n=args.n, logprobs=args.logprobs, prompt_logprobs=args.prompt_logprobs)
    sampling_params_from_args(args, **extra)  # a bad flag fails before the model loads
    if args.skip_tokenizer_init:  # the engine's error, after loading, asked for token ids
        raise ValueError("kiln generate takes prompt text, which needs the tokenizer: drop "
                         "--skip-tokenizer-init")
    engine_args = EngineArgs.from_cli_args(args)
    llm = LLM(**vars(engine_args))
    exit_if_stopped()
    try:
        # the flags given, over the model's sampling defaults (as LLM.generate's own)
        params = sampling_params_from_args(
            args, llm.llm_engine.model_config.generation_defaults, **extra)
        (output,) = llm.generate(prompt, params, use_tqdm=False)
    finally:
        llm.shutdown()
    if output.prompt_logprobs is not None:
        for pos, (token_id, entry) in enumerate(zip(output.prompt_token_ids,
                                                    output.prompt_logprobs)):
            print(json.dumps({"prompt_position": pos, "token_id": token_id,
                              "top": _top(entry) if entry is not None else None}),
                  file=sys.stderr)
    for completion in output.outputs:
        sys.stdout.write(completion.text + "\n")
        if completion.logprobs is not None:
            for token_id, entry in zip(completion.token_ids, completion.logprobs):
                print(json.dumps({"index": completion.index, "token_id": token_id,
                                  "top": _top(entry)}), file=sys.stderr)
    sys.stdout.flush()
    return 0


def _top(entry: dict) -> dict:
    return {str(t): {"logprob": lp.logprob, "rank": lp.rank, "token": lp.decoded_token}
            for t, lp in entry.items()}
