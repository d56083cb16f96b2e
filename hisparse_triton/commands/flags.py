"""Flags spelled the same way in every subcommand (no torch import): ``--top-k`` (with the
hidden old spelling ``--topk``), ``--seed`` and ``--progress/--no-progress``. ``--json`` is
``commands.output.add_json_flag``."""

from __future__ import annotations

import argparse
from typing import Any, Callable, Optional

from hisparse_triton.commands.argtypes import SEED_MAX, seed


def add_top_k_flag(parser: Any, *, type: Callable[[str], int], default: Optional[int],
                   help: str, dest: str = "top_k") -> None:
    """``--top-k N`` and the hidden alias ``--topk N`` (same destination)."""
    parser.add_argument("--top-k", dest=dest, type=type, default=default, metavar="N",
                        help=help)
    parser.add_argument("--topk", dest=dest, type=type, default=argparse.SUPPRESS,
                        help=argparse.SUPPRESS)


def add_seed_flag(parser: Any, *, default: int = 0, what: str = "the workload") -> None:
    """``--seed N`` in ``[0, 2**32 - 1]``."""
    parser.add_argument("--seed", type=seed, default=default, metavar="N",
                        help=f"random seed of {what}, in [0, {SEED_MAX}] (default {default})")


def add_progress_flag(parser: Any) -> None:
    """``--progress`` / ``--no-progress``; neither = a bar when stderr is a terminal."""
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                        help="a progress bar with an ETA on stderr (default: when stderr is "
                             "a terminal)")


__all__ = ["add_progress_flag", "add_seed_flag", "add_top_k_flag"]
