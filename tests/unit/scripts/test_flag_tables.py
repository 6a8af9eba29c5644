"""The flag tables of docs/configuration.md are the CLI's `--help`, so they cannot drift."""

from __future__ import annotations

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def _flag_tables():
    spec = importlib.util.spec_from_file_location("flag_tables", REPO / "scripts/flag_tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_configuration_doc_tables_equal_the_script_output():
    tables = _flag_tables()
    assert tables.TARGET == REPO / "docs" / "configuration.md"
    text = tables.TARGET.read_text(encoding="utf-8")
    for path in tables.COMMANDS:
        assert tables.block(path) in text, (
            f"docs/configuration.md's `{' '.join(path)}` flags differ from --help: "
            "run `python scripts/flag_tables.py --write`"
        )


def test_the_readme_links_to_the_tables():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    assert "docs/configuration.md" in readme
    assert "<!-- flags:" not in readme, "the flag tables live in docs/configuration.md only"


def test_the_table_lists_every_serve_flag_with_its_help():
    tables = _flag_tables()
    parser = tables.command_parser(("serve",))
    text = tables.flag_table(parser)
    for action in parser._actions:
        for flag in action.option_strings:
            assert flag in text or flag in ("-h", "--help")
    assert "| `--block-size BLOCK_SIZE` | tokens per KV block. (default: 16) |" in text
