"""`pagedinfer` command line: subcommands are registered by the modules that own them."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedinfer", description="paged-infer LLM inference engine")
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser("native-demo", help="exercise the native paged KV-cache core")
    demo.set_defaults(func=_native_demo)
    from pagedinfer.engine.server.cli_args import add_serve_parser

    add_serve_parser(sub)
    from pagedinfer.engine.generate_cli import add_generate_parser

    add_generate_parser(sub)
    from pagedinfer.operator.cli import add_operator_parsers

    add_operator_parsers(sub)
    return parser


def _native_demo(args: argparse.Namespace) -> int:
    from pagedinfer import _native

    print(f"pagedinfer._native {_native.version()}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
