"""Subcommands the operator package adds to the `pagedinfer` CLI: `operator` and `download`."""

from __future__ import annotations

import argparse


def add_operator_parsers(sub: argparse._SubParsersAction) -> None:
    """Register `pagedinfer operator ...` (main.run) and, unless the engine has one, `pagedinfer download`."""
    from pagedinfer.operator.main import add_arguments

    op = sub.add_parser("operator", help="run the InferenceEngine Kubernetes operator")
    add_arguments(op)
    op.set_defaults(func=_run_operator)
    if "download" not in sub.choices:
        from pagedinfer.operator.download import add_download_parser

        add_download_parser(sub)


def _run_operator(args: argparse.Namespace) -> int:
    from pagedinfer.operator.main import run

    return run(args)
