"""`kiln chat`: an interactive conversation, streaming each reply token by token.

Reads one user turn per stdin line until EOF or "exit"; keeps the history for the chat template
("/reset" forgets it, keeping the system prompt). vLLM's `vllm chat` flags --system-prompt and
--quick work as there.
"""
import argparse
import sys

from kiln.engine.arg_utils import EngineArgs
from kiln.engine.text_encoding import not_utf8
from kiln.entrypoints.cli.sampling_args import add_sampling_args, sampling_params_from_args
from kiln.process_signals import exit_if_stopped
from kiln.sampling_params import RequestOutputKind

EXIT_WORDS = ("exit", "quit", "/exit", "/quit")
RESET_WORD = "/reset"
HELP_WORD = "/help"
COMMANDS = f"{RESET_WORD} starts the conversation again, /exit (or end of input) stops"


def register(subparsers) -> None:
    parser = subparsers.add_parser("chat", help="chat interactively, streaming replies",
                                   description="Chat with a model; one user turn per line, "
                                               f"'{RESET_WORD}' to start the conversation "
                                               "again, 'exit' or end of input to stop.")
    # --system-prompt and --quick are vLLM's names (`vllm chat`), which were unrecognized
    # arguments; its -q is --quantization here, as in `vllm serve`
    parser.add_argument("--system", "--system-prompt", dest="system", default=None,
                        help="system prompt")
    parser.add_argument("--quick", metavar="MESSAGE", default=None,
                        help="send MESSAGE as the only turn, print the reply and exit")
    add_sampling_args(parser, max_tokens=512)
    EngineArgs.add_cli_args(parser)
    parser.set_defaults(func=run)


def stream_reply(engine, request_id: str, prompt: dict, params, out=None) -> str:
    """Run one request, writing text deltas to `out` (sys.stdout as it is at the call) as they
    come; returns the whole reply."""
    out = sys.stdout if out is None else out
    engine.add_request(request_id, prompt, params)
    pieces = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            text = output.outputs[0].text
            if text:
                pieces.append(text)
                out.write(text)
                out.flush()
    out.write("\n")
    out.flush()
    return "".join(pieces)


def run(args: argparse.Namespace) -> int:
    from kiln.engine.chat_template import require_chat_template
    from kiln.engine.llm_engine import LLMEngine
    from kiln.engine.tokenizer import get_tokenizer

    # Checked before the model loads: a bad flag is a usage error, not one per turn.
    sampling_params_from_args(args)
    if args.quick is not None and not args.quick.strip():  # a turn the model would answer
        raise ValueError("--quick needs a message to send, got an empty one; leave --quick "
                         "out to chat one line at a time")
    for flag, text in (("--system", args.system), ("--quick", args.quick)):
        # bytes that are not UTF-8 (lone surrogates): every turn failed, blamed on "messages"
        if text is not None and (problem := not_utf8(text)) is not None:
            raise ValueError(f"{flag} {problem}: pass UTF-8 text")
    if args.skip_tokenizer_init:  # found after the model loaded, at the first turn
        raise ValueError("kiln chat renders and tokenizes text, which needs the tokenizer: "
                         "drop --skip-tokenizer-init")
    engine_args = EngineArgs.from_cli_args(args)
    # No template at all is known from the tokenizer alone: found at the first turn, it cost a
    # whole model load and compile first.
    kiln_config = engine_args.create_kiln_config()
    model_config = kiln_config.model_config
    require_chat_template(get_tokenizer(model_config), model_config.chat_template,
                          model_config.model)
    engine = LLMEngine.from_engine_args(engine_args, kiln_config=kiln_config)
    exit_if_stopped()
    try:  # the flags given, over the model's sampling defaults
        params = sampling_params_from_args(args, engine.model_config.generation_defaults,
                                           output_kind=RequestOutputKind.DELTA)
    except ValueError:
        engine.shutdown()
        raise
    start = [{"role": "system", "content": args.system}] if args.system else []
    history = list(start)
    if args.quick is not None:  # one turn: its error is the command's (exit status 2)
        try:
            stream_reply(engine, "chat-0", engine.chat_prompt(
                start + [{"role": "user", "content": args.quick}]), params)
        finally:
            engine.shutdown()
        return 0
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"(one turn per line; {COMMANDS})", file=sys.stderr, flush=True)
    turn = 0
    try:
        while True:
            if interactive:
                print("user> ", end="", file=sys.stderr, flush=True)
            line = sys.stdin.readline()
            if not line:
                break
            line = line.rstrip("\r\n")  # a CRLF pipe (Windows files) sent "\r" to the model
            if line.strip().lower() in EXIT_WORDS:
                break
            if not line.strip():
                continue
            if line.strip() == RESET_WORD:
                history = list(start)
                print("(conversation reset)", file=sys.stderr, flush=True)
                continue
            if line.strip() == HELP_WORD:  # not a turn: the model was asked what "/help" is
                print(f"(one turn per line; {COMMANDS})", file=sys.stderr, flush=True)
                continue
            if (problem := not_utf8(line)) is not None:
                print(f"error: the line is {problem}; nothing was sent, type the turn again "
                      "in UTF-8", file=sys.stderr, flush=True)
                continue
            history.append({"role": "user", "content": line})
            try:
                prompt = engine.chat_prompt(history)
                reply = stream_reply(engine, f"chat-{turn}", prompt, params)
            except ValueError as e:
                history.pop()
                if turn == 0 and "chat template" in str(e):
                    raise  # no template, or a broken one: nothing later can work
                # A history past max_model_len fails every later turn: say how to go on.
                hint = f" ({RESET_WORD} starts over)" if len(history) > len(start) else ""
                print(f"error: {e}{hint}", file=sys.stderr)
                continue
            if not reply.strip():  # a blank line alone looks like a hang or a crash
                print(f"(empty reply: the model ended its turn at once; {RESET_WORD} starts "
                      "over)", file=sys.stderr, flush=True)
            history.append({"role": "assistant", "content": reply})
            turn += 1
    finally:
        engine.shutdown()
    return 0

