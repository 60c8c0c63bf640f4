"""docs/serving.md documents exactly the flags `pagedinfer serve --help` shows: one table row each."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from pagedinfer.engine.server.cli_args import add_serve_parser

DOC = Path(__file__).resolve().parents[2] / "docs" / "serving.md"
# A flag row's first cell: `--flag` or `--flag/--no-flag`.
ROW_RE = re.compile(r"^\| `(--[a-z0-9-]+)(?:/--no-[a-z0-9-]+)?` \|", re.MULTILINE)


def _serve_flags() -> set[str]:
    sub = argparse.ArgumentParser().add_subparsers()
    parser = add_serve_parser(sub)
    flags = set()
    for action in parser._actions:  # argparse has no public list of a parser's options
        longs = [o for o in action.option_strings if o.startswith("--") and o != "--help"]
        if isinstance(action, argparse.BooleanOptionalAction):
            longs = [o for o in longs if not o.startswith("--no-")]
        flags.update(longs)
    return flags


def _documented_flags() -> list[str]:
    return ROW_RE.findall(DOC.read_text())


def test_every_serve_flag_has_a_row_in_docs_serving_md():
    missing = sorted(_serve_flags() - set(_documented_flags()))
    assert not missing, (
        "`pagedinfer serve` has flags without a row in docs/serving.md: "
        + ", ".join(missing)
        + " (add a table row `| `--flag` | default | when to change it |`)"
    )


def test_docs_serving_md_documents_no_flag_that_is_gone():
    gone = sorted(set(_documented_flags()) - _serve_flags())
    assert not gone, (
        "docs/serving.md has rows for flags `pagedinfer serve` no longer has: "
        + ", ".join(gone)
        + " (delete their rows)"
    )


def test_each_flag_has_one_row():
    rows = _documented_flags()
    twice = sorted({f for f in rows if rows.count(f) > 1})
    assert not twice, f"docs/serving.md has more than one row for: {', '.join(twice)}"


def test_boolean_flags_show_their_negative_form():
    sub = argparse.ArgumentParser().add_subparsers()
    parser = add_serve_parser(sub)
    text = DOC.read_text()
    for action in parser._actions:
        if isinstance(action, argparse.BooleanOptionalAction):
            flag = action.option_strings[0]
            negative = "--no-" + flag.removeprefix("--")
            assert f"`{flag}/{negative}`" in text, (
                f"docs/serving.md: write {flag}'s row as `{flag}/{negative}`"
            )
