"""``tandem``: the one command that starts everything.

    tandem up                                            a local cluster on :8000
    tandem generate --prompts in.jsonl --out out.jsonl   offline generation
    tandem bench offline|serve|sweep|plot|kv-transfer|router|gateway|structured    benchmarks
    tandem router|prefill|decode|worker|gateway          one service (what compose runs)

Startup errors a user can fix (missing model, unsupported architecture, bad flag values,
a cache too small for the context) end the command with a one-line reason and status 2.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from common.flags import add_engine_flags, engine_config


def _quiet_libraries() -> None:
    # No hub traffic ever: models come from disk. Keep third-party chatter off stderr.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--log-level", default=os.environ.get("TANDEM_LOG_LEVEL", "info"))
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="run a JSONL file of prompts offline")
    gen.add_argument("--prompts", required=True, help="input JSONL, one request per line")
    gen.add_argument("--out", required=True, help="output JSONL, one result per input line")
    gen.add_argument("--max-tokens", type=int, default=256,
                     help="max_tokens for lines that do not set it")
    add_engine_flags(gen)
    gen.set_defaults(func=_generate)

    from services import commands, launcher

    launcher.add_arguments(sub.add_parser("up", help="start a whole local cluster"))
    commands.add_service_parsers(sub)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench", required=True)
    from loadtest import (
        gateway_stream,
        kv_transfer,
        offline,
        router_bench,
        serve,
        structured_overhead,
        sweep,
        sweep_plots,
    )

    offline.add_arguments(bench_sub.add_parser("offline", help="offline throughput vs HF transformers"))
    serve.add_arguments(bench_sub.add_parser("serve", help="online serving against any OpenAI URL"))
    sweep.add_arguments(bench_sub.add_parser("sweep", help="serve at several rates: goodput + plots"))
    sweep_plots.add_arguments(bench_sub.add_parser("plot", help="overlay sweep JSONs in one set of plots"))
    kv_transfer.add_arguments(bench_sub.add_parser("kv-transfer", help="KV connector vs raw ZeroMQ"))
    router_bench.add_arguments(bench_sub.add_parser("router", help="one router against a simulated fleet"))
    gateway_stream.add_arguments(bench_sub.add_parser(
        "gateway", help="the gateway's CPU per streamed token, against a fake router"))
    structured_overhead.add_arguments(bench_sub.add_parser(
        "structured", help="per-output-token cost of a JSON-schema constraint, c1 and c16"))
    return parser


def _generate(args: argparse.Namespace) -> int:
    from common.engine.engine import Engine
    from services import generate

    if not os.path.isfile(args.prompts):
        raise ValueError(f"prompts file {args.prompts} does not exist")
    engine = Engine(engine_config(args))
    return generate.main(engine, args.prompts, args.out, args.max_tokens)


def main(argv: list[str] | None = None) -> int:
    _quiet_libraries()
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except (ValueError, OSError) as e:  # user-fixable: bad flags, models, files
        print(f"tandem: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
