"""Every flag of every `pagedserve` subcommand is named in README.md or docs/ (the project rule:
keep the README true, every flag a user needs)."""

import argparse
import re
from pathlib import Path

from pagedserve.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]


def _flags_by_command() -> dict[str, set[str]]:
    commands = next(a for a in build_parser()._actions
                    if isinstance(a, argparse._SubParsersAction))
    return {name: {o for action in parser._actions for o in action.option_strings
                   if o.startswith("--") and o != "--help"}
            for name, parser in commands.choices.items()}


def test_every_flag_is_documented():
    docs = "\n".join(p.read_text() for p in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
    named = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", docs))
    missing = sorted(f"{command} {flag}" for command, flags in _flags_by_command().items()
                     for flag in flags
                     if flag not in named and flag.replace("--no-", "--", 1) not in named
                     and "--no-" + flag[2:] not in named)
    assert not missing, f"flags no doc names (docs/cli.md has the tables): {missing}"
