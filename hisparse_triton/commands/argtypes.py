"""argparse value types shared by the subcommands (no torch import).

Each raises ``argparse.ArgumentTypeError`` with a message naming the bad text, which the CLI
prints as one line. Integers accept a ``k`` suffix (``4k`` = 4096).
"""

from __future__ import annotations

import argparse
import math
import os
from typing import Callable


def _integer(text: str) -> int:
    part = text.strip()
    scale = 1
    if part[-1:] in ("k", "K"):
        scale, part = 1024, part[:-1]
    try:
        return int(part) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None


def positive_int(text: str) -> int:
    """An integer >= 1."""
    value = _integer(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {text!r}")
    return value


def nonnegative_int(text: str) -> int:
    """An integer >= 0."""
    value = _integer(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}")
    return value


def positive_float(text: str) -> float:
    """A finite number > 0."""
    value = _number(text)
    if not value > 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value


def fraction(text: str) -> float:
    """A number in ``[0, 1]``."""
    value = _number(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1], got {text!r}")
    return value


def int_list(text: str) -> tuple[int, ...]:
    """``"512,4k,256k"`` -> ``(512, 4096, 262144)``: distinct integers >= 1, in order."""
    parts = [p for p in text.replace(" ", "").split(",") if p]
    if not parts:
        raise argparse.ArgumentTypeError(f"expected at least one integer, got {text!r}")
    return tuple(dict.fromkeys(positive_int(p) for p in parts))


def ratio_list(text: str) -> tuple[float, ...]:
    """``"1,0.3,0.067"`` -> distinct ratios in ``(0, 1]``, in order."""
    parts = [p for p in text.replace(" ", "").split(",") if p]
    values = tuple(_number(p) for p in parts)
    if not values or any(not 0 < v <= 1 for v in values):
        raise argparse.ArgumentTypeError(f"ratios must lie in (0, 1], got {text!r}")
    return tuple(dict.fromkeys(values))


def choice_list(choices: tuple[str, ...]) -> Callable[[str], tuple[str, ...]]:
    """A type for comma-separated names out of ``choices`` (``all`` = every one)."""

    def parse(text: str) -> tuple[str, ...]:
        names = [p for p in text.replace(" ", "").split(",") if p]
        if names == ["all"]:
            return choices
        bad = [n for n in names if n not in choices]
        if bad or not names:
            raise argparse.ArgumentTypeError(
                f"unknown {', '.join(bad) or 'empty list'}; choose from {', '.join(choices)}")
        return tuple(dict.fromkeys(names))

    return parse


def op_list(allowed: tuple[str, ...]) -> Callable[[str], tuple[str, ...]]:
    """A type for comma-separated benchmark ops out of ``allowed``: op names or groups of the
    op registry (``rows``, ``pages``, ``transfers``, ``all``; ``benchmarks.registry``)."""

    def parse(text: str) -> tuple[str, ...]:
        from hisparse_triton.benchmarks.registry import expand_ops

        names = [p for p in text.replace(" ", "").split(",") if p]
        if not names:
            raise argparse.ArgumentTypeError(f"unknown empty list; choose from "
                                             f"{', '.join(allowed)}")
        try:
            return expand_ops(names, allowed)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    return parse


def output_path(text: str) -> str:
    """A file to write: its directory must exist and the path must not be a directory
    (checked when the flags are parsed, not after a long run)."""
    if not text:
        raise argparse.ArgumentTypeError("expected a file path, got ''")
    if os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"{text!r} is a directory, expected a file path")
    directory = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(directory):
        raise argparse.ArgumentTypeError(f"directory {directory!r} of {text!r} does not exist")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"directory {directory!r} of {text!r} is not "
                                         f"writable")
    return text


def output_path_or_stdout(text: str) -> str:
    """``-`` (stdout) or an ``output_path``."""
    return text if text == "-" else output_path(text)


def bounded_number(low: float, high: float, unit: str = "",
                   hint: str = "") -> Callable[[str], float]:
    """A type for a finite number in ``[low, high]``; the message names the plausible range
    (``unit`` after the numbers) and ``hint`` (e.g. "a value this large is surely bytes")."""

    def parse(text: str) -> float:
        value = _number(text)
        if not (math.isfinite(value) and low <= value <= high):
            extra = f" ({hint})" if hint else ""
            raise argparse.ArgumentTypeError(
                f"must be a number in [{low:g}, {high:g}]{unit}, got {text!r}{extra}")
        return value

    return parse


def bounded_int(low: int, high: int, unit: str = "") -> Callable[[str], int]:
    """A type for an integer in ``[low, high]`` (``k`` suffix accepted)."""

    def parse(text: str) -> int:
        value = _integer(text)
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(
                f"must be an integer in [{low}, {high}]{unit}, got {text!r}")
        return value

    return parse


#: Largest seed any command takes (numpy and torch seeds are 32-bit here).
SEED_MAX = 2**32 - 1

#: ``--seed``: an integer in ``[0, 2**32 - 1]``.
seed = bounded_int(0, SEED_MAX)


def bounded_int_list(low: int, high: int, unit: str = "") -> Callable[[str], tuple[int, ...]]:
    """Like ``int_list``, every value in ``[low, high]`` (the message names the range)."""
    one = bounded_int(low, high, unit)

    def parse(text: str) -> tuple[int, ...]:
        parts = [p for p in text.replace(" ", "").split(",") if p]
        if not parts:
            raise argparse.ArgumentTypeError(f"expected at least one integer, got {text!r}")
        return tuple(dict.fromkeys(one(p) for p in parts))

    return parse


def existing_file(text: str) -> str:
    """A path to a readable file (checked when the flags are parsed)."""
    if not os.path.isfile(text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a file")
    if not os.access(text, os.R_OK):
        raise argparse.ArgumentTypeError(f"{text!r} is not readable")
    return text
