"""Flags spelled the same way in every subcommand (no torch import): ``--top-k`` (with the
hidden old spelling ``--topk``), ``--seed``, ``--device``, ``--threads`` and
``--progress/--no-progress``.
``--json`` is ``commands.output.add_json_flag``."""

from __future__ import annotations

import argparse
import os
from typing import Any, Callable, Optional

from hisparse_triton.commands.argtypes import SEED_MAX, positive_int, seed


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


def add_device_flag(parser: Any, *, help: str = "where to run") -> None:
    """``--device auto|cpu|cuda|cuda:N`` (default auto: CUDA when available, else the CPU);
    the command resolves it with ``simulation.resolve_device`` (one line naming a bad value)."""
    parser.add_argument("--device", default="auto", metavar="auto|cpu|cuda|cuda:N",
                        help=f"{help}: auto (default: cuda when available, else cpu), cpu, "
                             f"cuda or cuda:N")


def add_threads_flag(parser: Any, *, default: Optional[int], help: str) -> None:
    """``--threads N``: torch's CPU threads (``set_torch_threads`` applies it)."""
    parser.add_argument("--threads", type=positive_int, default=default, metavar="N",
                        help=help)


def available_cpus() -> int:
    """CPUs this process may run on (its affinity mask, else the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def set_torch_threads(threads: Optional[int]) -> int:
    """Give torch ``threads`` CPU threads (``None``: leave its default); returns the count in
    use. ``ValueError`` above the CPUs this process may use (thousands of OpenMP threads fail
    to start or crash the process). Imports torch."""
    cpus = available_cpus()
    if threads is not None and threads > cpus:
        raise ValueError(f"--threads {threads} exceeds the {cpus} CPUs available to this "
                         f"process.")
    import torch

    if threads is not None:
        torch.set_num_threads(threads)
    return torch.get_num_threads()


def add_progress_flag(parser: Any) -> None:
    """``--progress`` / ``--no-progress``; neither = a bar when stderr is a terminal."""
    parser.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                        help="a progress bar with an ETA on stderr (default: when stderr is "
                             "a terminal)")


__all__ = ["add_device_flag", "add_progress_flag", "add_seed_flag", "add_threads_flag",
           "add_top_k_flag", "available_cpus", "set_torch_threads"]
