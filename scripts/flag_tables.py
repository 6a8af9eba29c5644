"""Print the flag tables of docs/configuration.md from the CLI's own parsers (what `--help`
prints).

    python scripts/flag_tables.py              # print the tables
    python scripts/flag_tables.py --write      # replace the marked blocks of docs/configuration.md
    python scripts/flag_tables.py --write F    # ... of another file

Each table sits between `<!-- flags:COMMAND -->` and `<!-- /flags:COMMAND -->`;
`tests/unit/scripts/test_flag_tables.py` fails when a block of docs/configuration.md differs
from this output.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

from pagedserve.cli import build_parser

COMMANDS: tuple[tuple[str, ...], ...] = (("serve",),)
# The file that holds the tables (README.md links to it).
TARGET = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"


def command_parser(path: tuple[str, ...]) -> argparse.ArgumentParser:
    parser = build_parser()
    for name in path:
        parser = _subcommands(parser)[name]
    return parser


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices
    raise KeyError(f"{parser.prog} has no subcommands")


def flag_table(parser: argparse.ArgumentParser) -> str:
    """One Markdown table per argument group: the flag as `--help` spells it, and its help."""
    formatter = parser._get_formatter()
    sections = []
    for group in parser._action_groups:
        actions = [
            a
            for a in group._group_actions
            if a.option_strings and not isinstance(a, argparse._HelpAction)
        ]
        rows = [f"| {_cell(_flag(formatter, a))} | {_cell(_help(formatter, a))} |" for a in actions]
        if rows:
            sections.append("\n".join([f"**{group.title}**", "", "| flag | |", "|---|---|", *rows]))
    return "\n\n".join(sections)


def _flag(formatter: argparse.HelpFormatter, action: argparse.Action) -> str:
    # `--x X` / `--x {a,b}` / `--x, --no-x`, as the help's own left column.
    return ", ".join(
        f"`{part}`" for part in formatter._format_action_invocation(action).split(", ")
    )


def _help(formatter: argparse.HelpFormatter, action: argparse.Action) -> str:
    return formatter._expand_help(action) if action.help else ""


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def block(path: tuple[str, ...]) -> str:
    """The marked block of one command's table, markers included."""
    name = " ".join(path)
    return f"<!-- flags:{name} -->\n{flag_table(command_parser(path))}\n<!-- /flags:{name} -->"


def rewrite(text: str) -> str:
    """`text` with every command's block replaced by the current one."""
    for path in COMMANDS:
        name = re.escape(" ".join(path))
        pattern = re.compile(rf"<!-- flags:{name} -->.*?<!-- /flags:{name} -->", re.DOTALL)
        if not pattern.search(text):
            raise ValueError(f"no <!-- flags:{' '.join(path)} --> block")
        text = pattern.sub(lambda _: block(path), text)  # noqa: B023 (called at once)
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--write",
        nargs="?",
        const=str(TARGET),
        metavar="FILE",
        help="replace the blocks in this file (default: docs/configuration.md)",
    )
    args = parser.parse_args(argv)
    if args.write:
        path = Path(args.write)
        path.write_text(rewrite(path.read_text(encoding="utf-8")), encoding="utf-8")
        return 0
    print("\n\n".join(block(path) for path in COMMANDS))
    return 0


if __name__ == "__main__":
    sys.exit(main())
