"""Integer flags take a whole number written the way the docs write large counts (`--chips 1e21`, `--inner-steps
2e3`): `ddiloco plan goodput --chips 1e21`, quoted in docs/planning.md, was refused as `invalid int value`, while float
flags beside it (`--params 12e9`) took the same spelling. A fraction is still refused, in argparse's words."""

import argparse
from dataclasses import dataclass

import pytest

from ddiloco.flags import add_config_flags, whole_number


@dataclass(frozen=True)
class Counts:
    chips: int = 1
    """chips"""
    rate: float = 1.0
    """a float beside it"""


def _parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_config_flags(parser, Counts)
    return parser.parse_args(list(argv))


@pytest.mark.parametrize(("text", "value"), [("1000", 1000), ("1e21", 10**21), ("1.2e6", 1_200_000), ("600.0", 600),
                                             ("12345678901234567891", 12345678901234567891), ("-3", -3)])
def test_a_whole_number_in_any_spelling_is_taken_exactly(text, value):
    assert whole_number(text) == value and type(whole_number(text)) is int
    assert _parse("--chips", text).chips == value


@pytest.mark.parametrize("text", ["1.5", "1e-3", "inf", "nan", "ten", ""])
def test_anything_else_is_refused_as_an_invalid_int(text, capsys):
    parser = argparse.ArgumentParser(prog="p")
    add_config_flags(parser, Counts)
    with pytest.raises(SystemExit):
        parser.parse_args(["--chips", text])
    assert f"argument --chips: invalid int value: '{text}'" in capsys.readouterr().err
