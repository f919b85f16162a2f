"""`clora config docs`: print (or write) the configuration reference, generated from the models.

    clora config docs --out docs/configuration.md

Not here: the reference itself (`clora_feedback.config_reference`), the settings (`config`).
"""

from __future__ import annotations

import argparse
from pathlib import Path


def add_config_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Add `config` and its actions to the `clora` parser's subcommands (sets `func`)."""
    parser = subparsers.add_parser("config", help="The settings: their reference page.")
    actions = parser.add_subparsers(dest="config_action", required=True)
    docs = actions.add_parser(
        "docs",
        help="The configuration reference (Markdown), generated from the settings models.",
        description="Every setting with its CLORA_* variable, type, default and description.",
    )
    docs.add_argument("--out", type=Path, help="write it here (default: standard output)")
    docs.set_defaults(func=run_config_docs)


def run_config_docs(args: argparse.Namespace) -> int:
    """Print or write the reference; returns the exit status."""
    from clora_feedback.config_reference import render

    text = render()
    if args.out is None:
        print(text, end="")
    else:
        args.out.write_text(text)
    return 0
