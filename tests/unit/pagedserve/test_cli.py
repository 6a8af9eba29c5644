"""The `pagedserve` CLI wires every command module it lists; none may be skipped silently."""

from __future__ import annotations

import argparse
import importlib

import pytest

from pagedserve.bench.cli import BENCH_MODULES
from pagedserve.cli import COMMAND_MODULES, build_parser


def _has_subcommands(parser: argparse.ArgumentParser) -> bool:
    return any(isinstance(a, argparse._SubParsersAction) for a in parser._actions)


def _subparsers(parser: argparse.ArgumentParser) -> argparse._SubParsersAction:
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))


def _commands(parser: argparse.ArgumentParser) -> set[str]:
    return set(_subparsers(parser).choices)


@pytest.mark.parametrize("module_name", COMMAND_MODULES + BENCH_MODULES)
def test_every_listed_module_imports_and_registers_a_command(module_name):
    parser = argparse.ArgumentParser()
    subparsers = parser.add_subparsers()
    importlib.import_module(module_name).register(subparsers)
    assert subparsers.choices, f"{module_name}.register added no command"
    for command in subparsers.choices.values():  # runs something, or groups commands that do
        assert command.get_default("func") is not None or _has_subcommands(command)


def test_the_parser_has_every_command():
    parser = build_parser()
    assert {"serve", "generate", "status", "kv-calc", "bench", "trace"} <= _commands(parser)
    bench_parser = _subparsers(parser).choices["bench"]
    assert len(_commands(bench_parser)) == len(BENCH_MODULES)


def test_a_missing_command_module_is_an_error(monkeypatch):
    import pagedserve.cli as cli

    monkeypatch.setattr(cli, "COMMAND_MODULES", (*COMMAND_MODULES, "pagedserve.no_such_part"))
    with pytest.raises(ModuleNotFoundError):
        cli.build_parser()
