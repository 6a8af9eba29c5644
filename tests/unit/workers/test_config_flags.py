"""Flags derived from config dataclasses: names, types, choices, help, only-given values."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field

import pytest

from pagedserve.workers.config_flags import add_config_flags, attribute_docs, config_flags_set


@dataclass(frozen=True)
class Sample:
    """A config.

    Attributes:
        block_size: tokens per block; a longer
            description on two lines.
        ratio: a fraction (100% is 1.0).
        mode: how it runs.
        enabled: whether it is on.
        limit: at most this many, or None.
        table: not a scalar: no flag.
    """

    block_size: int = 16
    ratio: float = 0.5
    mode: str = field(default="fast", metadata={"choices": ("fast", "slow")})
    enabled: bool = True
    limit: int | None = None
    table: dict[str, int] = field(default_factory=dict)


def parser_for(**kwargs) -> tuple[argparse.ArgumentParser, list[str]]:
    parser = argparse.ArgumentParser()
    return parser, add_config_flags(parser, Sample, **kwargs)


def test_every_scalar_field_gets_a_flag_and_only_given_flags_are_set():
    parser, added = parser_for()
    assert added == ["block_size", "ratio", "mode", "enabled", "limit"]
    assert config_flags_set(parser.parse_args([]), Sample) == {}
    args = parser.parse_args(
        ["--block-size", "8", "--ratio", "0.25", "--mode", "slow", "--no-enabled", "--limit", "3"]
    )
    assert config_flags_set(args, Sample) == {
        "block_size": 8,
        "ratio": 0.25,
        "mode": "slow",
        "enabled": False,
        "limit": 3,
    }
    assert Sample(**config_flags_set(args, Sample)).limit == 3


@pytest.mark.parametrize(
    "argv",
    [["--mode", "medium"], ["--block-size", "x"], ["--ratio", "nan"], ["--ratio", "inf"]],
)
def test_bad_values_are_refused_naming_the_flag(argv, capsys):
    parser, _ = parser_for()
    with pytest.raises(SystemExit):
        parser.parse_args(argv)
    assert argv[0] in capsys.readouterr().err


def test_help_comes_from_the_docstring_with_the_default():
    parser, _ = parser_for(exclude=["ratio"])
    text = parser.format_help()
    assert "tokens per block; a longer description on two lines. (default: 16)" in " ".join(
        text.split()
    )
    assert "--ratio" not in text and "{fast,slow}" in text
    assert attribute_docs(Sample)["ratio"] == "a fraction (100% is 1.0)."
