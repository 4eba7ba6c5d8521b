"""Worker-side verbs of the `ember` command: generate, bench."""

from __future__ import annotations

import argparse
import sys

from ember.ops.contract import Event, ExitCode

EX_USAGE = ExitCode.USAGE
EX_CONFIG = ExitCode.CONFIG  # the worker contract's "configuration error: do not restart"


def _add_model_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", metavar="PATH", help="GGUF model file (default: the embedded Gemma 3 270M)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ember", description="ember worker commands")
    sub = parser.add_subparsers(dest="verb", required=True)

    g = sub.add_parser("generate", help="stream a completion of a prompt to stdout")
    _add_model_arg(g)
    g.add_argument("prompt", help="the prompt text ('-' reads standard input)")
    g.add_argument("--chat", action="store_true", help="wrap the prompt as a user turn in the model's chat template")
    g.add_argument("--system", help="system prompt (with --chat)")
    g.add_argument("--max-tokens", type=int, default=256, metavar="N", help="most tokens to generate (default 256)")
    g.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=0, metavar="K")
    g.add_argument("--top-p", type=float, default=1.0, metavar="P")
    g.add_argument("--min-p", type=float, default=0.0, metavar="P")
    g.add_argument("--repeat-penalty", type=float, default=1.0, metavar="R")
    g.add_argument("--seed", type=int, default=None, metavar="S", help="seed for reproducible sampling")
    g.set_defaults(func=cmd_generate)

    w = sub.add_parser("worker", help="serve the OpenAI and Anthropic HTTP APIs (the process the daemon supervises)")
    from . import config as worker_config

    worker_config.add_arguments(w)
    w.set_defaults(func=cmd_worker)

    from .bench.cli import add_bench_parser

    add_bench_parser(sub)
    from ember.kernels.cli import add_kernels_parser

    add_kernels_parser(sub)
    return parser


def cmd_generate(args: argparse.Namespace) -> int:
    from .engine.sampling import SamplingParams
    from .runtime import GenerationStats, Runtime, generate
    from .text.prompt import encode_chat
    from .text.tokenizer import IncrementalDecoder

    params = SamplingParams(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
        repetition_penalty=args.repeat_penalty, seed=args.seed,
    )
    bad = params.validate()
    if bad:
        print(f"ember: --{bad.replace('_', '-')} is out of range", file=sys.stderr)
        return EX_USAGE
    if args.max_tokens < 1:
        print("ember: --max-tokens must be at least 1", file=sys.stderr)
        return EX_USAGE
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    runtime = Runtime.load(args.model)
    model = runtime.model
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
            {"role": "user", "content": prompt}
        ]
        ids = encode_chat(model.tokenizer, model.template.render(messages))
    else:
        ids = model.tokenizer.encode(prompt, add_special=True)
    limit = model.config.context_length
    if len(ids) >= limit:
        print(f"ember: the prompt has {len(ids)} tokens; the model's context is {limit}", file=sys.stderr)
        return EX_USAGE
    stats = GenerationStats()
    decoder = IncrementalDecoder(model.tokenizer)
    out = sys.stdout
    for token in generate(runtime, ids, params, min(args.max_tokens, limit - len(ids)), stats):
        text = decoder.feed(token)
        if text:
            out.write(text)
            out.flush()
    out.write(decoder.flush() + "\n")
    out.flush()
    print(
        f"prefill: {stats.prompt_tokens} tokens at {stats.prefill_tps:.1f} tok/s | "
        f"decode: {stats.generated_tokens} tokens at {stats.decode_tps:.1f} tok/s",
        file=sys.stderr,
    )
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    from . import config as worker_config
    from .logs import log

    try:
        cfg, sources = worker_config.load(args)
    except worker_config.ConfigError as e:
        log(Event.CONFIG_ERROR, level="error", error=str(e))
        return EX_CONFIG
    from .server import serve

    return serve(cfg, sources)


def main(argv: list[str] | None = None) -> int:
    from .model.gguf_file import ModelFileError
    from .text.chat_template import ChatTemplateError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ModelFileError as e:
        print(f"ember: {e}", file=sys.stderr)
        return EX_CONFIG
    except ChatTemplateError as e:
        print(f"ember: chat template: {e}", file=sys.stderr)
        return EX_CONFIG
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return ExitCode.INTERRUPTED
    except BrokenPipeError:
        return 0


if __name__ == "__main__":
    sys.exit(main())
