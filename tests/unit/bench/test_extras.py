"""A bench command that needs the `bench` extra and lacks it says what to install, exit 2."""

from __future__ import annotations

import argparse
import sys

import pytest

from pagedserve import cli
from pagedserve.bench.extras import INSTALL_HINT


def test_kv_calc_plot_without_matplotlib_names_the_extra(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now fails
    argv = ["kv-calc", "--lengths", "37", "--block-sizes", "16", "--max-len", "64"]
    assert cli.main([*argv, "--plot", str(tmp_path / "kv.png")]) == 2
    assert f"matplotlib is not installed: {INSTALL_HINT}" in capsys.readouterr().err
    assert not (tmp_path / "kv.png").exists()
    assert cli.main(argv) == 0  # no plot, no matplotlib needed


def _parser_running(func) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    parser.add_subparsers().add_parser("x").set_defaults(func=func)
    return parser


def _raise(name: str):
    def func(args: argparse.Namespace) -> int:
        raise ModuleNotFoundError(f"No module named {name!r}", name=name)

    return func


def test_a_late_import_of_an_extra_module_is_the_same_error(monkeypatch, capsys):
    monkeypatch.setattr(cli, "build_parser", lambda: _parser_running(_raise("tqdm.auto")))
    assert cli.main(["x"]) == 2
    assert INSTALL_HINT in capsys.readouterr().err


def test_any_other_missing_module_is_a_crash_not_a_hint(monkeypatch):
    monkeypatch.setattr(cli, "build_parser", lambda: _parser_running(_raise("torch")))
    with pytest.raises(ModuleNotFoundError, match="torch"):
        cli.main(["x"])
