"""Spawned gloo ranks for the tensor-parallel tests: start them, and bring a rank's
traceback back to the test that started it."""

from __future__ import annotations

import os
import traceback
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator

import torch.multiprocessing as mp


@contextmanager
def reporting_errors(result_dir: str, rank: int) -> Iterator[None]:
    """In a spawned rank: on any exception, write its traceback to
    ``result_dir/rank{rank}.error`` (``spawn_ranks`` reports it), then re-raise."""
    try:
        yield
    except BaseException:
        with open(os.path.join(result_dir, f"rank{rank}.error"), "w") as out:
            out.write(traceback.format_exc())
        raise


def spawn_ranks(fn: Callable[..., None], world: int, args: tuple[Any, ...],
                result_dir: Path) -> None:
    """``fn(rank, *args)`` in ``world`` spawned processes; ``AssertionError`` with every
    rank's traceback (``reporting_errors``) when one fails."""
    try:
        mp.start_processes(fn, args=args, nprocs=world, join=True, start_method="spawn")
    except Exception:
        errors = [p.read_text() for p in result_dir.glob("rank*.error")]
        raise AssertionError("a rank failed:\n" + "\n".join(errors))
