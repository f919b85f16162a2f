"""The `clora` command line: `serve`, `ingest`, `train`, `store`, `demo`, `feedback`, `adapters`,
`config`, `bench`.

Argument parsing only; each subcommand hands typed settings to the component
that does the work. Environment variables are read by `clora_feedback.config`.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from clora_feedback.cores import configure_waits


def _serve(args: argparse.Namespace) -> int:
    from clora_feedback.config import load_settings
    from clora_feedback.service import serve

    vllm = {"urls": list(args.vllm_url)} if args.vllm_url else None
    engine = {"model": args.model, "kind": args.engine, "vllm": vllm}
    serve(load_settings(args.config, host=args.host, port=args.port, engine=engine))
    return 0


def _demo(args: argparse.Namespace) -> int:
    from clora_feedback.demo.runner import run

    return run(args.extra)


def _bench(args: argparse.Namespace) -> int:
    from clora_feedback.bench import run_bench

    return run_bench(args.what, args.extra)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="clora", description="Agents that keep learning from their users."
    )
    parser.add_argument("--log-level", default="INFO", help="Python logging level (default INFO).")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser(
        "serve", help="Run the OpenAI-compatible gateway (embedded engine, or vLLM servers)."
    )
    serve.add_argument("--host", default=None, help="Bind address (default 127.0.0.1).")
    serve.add_argument("--port", type=int, default=None, help="Port (default 8000).")
    serve.add_argument("--config", type=Path, default=None, help="JSON or YAML settings file.")
    serve.add_argument(
        "--model", default=None, help="Base model: the default name or a HF model directory."
    )
    serve.add_argument(
        "--engine", choices=("embedded", "vllm"), default=None, help="Engine kind (engine.kind)."
    )
    serve.add_argument(
        "--vllm-url",
        action="append",
        default=None,
        help="A vLLM OpenAI server's base URL (engine.vllm.urls; repeatable, one per replica). "
        "With --engine vllm and no URL, a local vLLM server is started and supervised "
        "(engine.vllm.local).",
    )
    serve.set_defaults(func=_serve)

    demo = sub.add_parser(
        "demo",
        help="Watch simulated users teach a support and a coding agent (`clora demo --help`).",
        add_help=False,
    )
    # The demo parses its own options (`clora_feedback.demo.runner`); they arrive as leftovers.
    demo.set_defaults(func=_demo, takes_extra=True)

    from clora_feedback.cli.adapters import add_adapters_parser
    from clora_feedback.cli.config import add_config_parser
    from clora_feedback.cli.feedback import add_feedback_parser
    from clora_feedback.cli.ingest import add_ingest_parser
    from clora_feedback.cli.store import add_store_parser
    from clora_feedback.cli.train import add_train_parser

    add_ingest_parser(sub)
    add_train_parser(sub)
    add_store_parser(sub)
    add_feedback_parser(sub)
    add_adapters_parser(sub)
    add_config_parser(sub)

    bench = sub.add_parser(
        "bench",
        help="Run a benchmark against a gateway and print its table (white-box ones: "
        "python -m benchmarks.<name> in the repository).",
    )
    from clora_feedback.bench import BENCHMARKS

    bench.add_argument("what", choices=tuple(BENCHMARKS), help="Which benchmark.")
    bench.add_argument("extra", nargs=argparse.REMAINDER, help="Options passed to the benchmark.")
    bench.set_defaults(func=_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    # Idle OpenMP workers spin briefly, then sleep (`cores`): OpenMP reads this once, when
    # torch loads, which has not happened yet here.
    waits = configure_waits()
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if getattr(args, "takes_extra", False):
        args.extra = extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger(__name__).debug("%s", waits)
    result: int = args.func(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
