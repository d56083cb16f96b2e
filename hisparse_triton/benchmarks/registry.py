"""The benchmark op registry: every op ``bench``, ``tune``, ``bench/gpu_check.py`` and the
pytest-benchmark suites under ``bench/`` know, in one table (pure Python: no torch).

An op is measured by ``bench`` (``--ops``); a *tunable* op is a transfer kernel with launch
configs that ``tune`` searches (``--kernel``). Every name list elsewhere is derived from
``BENCH_OPS`` (``op_names``), so adding an op is one entry here plus its measurement.

| op | kind | direction | tunable | what moves |
| --- | --- | --- | --- | --- |
| ``gather`` | rows | h2d | yes | the misses of a decode step, host pool -> hot rows |
| ``backup`` | rows | d2h | yes | new rows, device -> host pool (the mirror) |
| ``restore`` | pages | h2d | yes | whole pages, host pool -> device |
| ``spill`` | pages | d2h | yes | whole pages, device -> host pool |
| ``resolve`` | resolve | - | no | top-k positions -> device rows (latency) |

Op groups: besides an op's name, the ``--ops`` / ``--kernel`` lists of the CLI accept a
group (``GROUPS``): ``rows``, ``pages``, ``transfers`` (rows and pages) and ``all``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Optional

#: Op kinds: a row copy, a page copy, or the resolve kernel.
KINDS = ("rows", "pages", "resolve")


@dataclass(frozen=True)
class BenchOp:
    """One benchmark op.

    - ``kind``: ``rows`` (a ``copy_rows`` plan), ``pages`` (a ``copy_pages`` plan of
      ``BLOCK_SIZE``-row pages) or ``resolve``;
    - ``direction``: ``"h2d"`` / ``"d2h"`` for a transfer, ``None`` for resolve;
    - ``launcher``: ``"module:function"`` of the Triton launcher under
      ``hisparse_triton.kernels`` that ``tune`` times (``None``: not tunable);
    - ``summary``: one line for help texts.
    """

    name: str
    kind: str
    direction: Optional[str]
    launcher: Optional[str]
    summary: str

    @property
    def tunable(self) -> bool:
        """Whether ``tune`` searches launch configs of this op."""
        return self.launcher is not None

    @property
    def is_transfer(self) -> bool:
        return self.kind in ("rows", "pages")


BENCH_OPS: dict[str, BenchOp] = {op.name: op for op in (
    BenchOp("gather", "rows", "h2d", "gather:gather_rows",
            "host rows -> device rows (a decode step's misses)"),
    BenchOp("backup", "rows", "d2h", "backup:backup_rows",
            "device rows -> host rows (the mirror of new KV)"),
    BenchOp("restore", "pages", "h2d", "gather:restore_pages", "host pages -> device pages"),
    BenchOp("spill", "pages", "d2h", "backup:spill_pages", "device pages -> host pages"),
    BenchOp("resolve", "resolve", None, None,
            "top-k positions -> device rows (resident, hot hit, or a miss)"),
)}


def op_names(*, kinds: Optional[Iterable[str]] = None,
             tunable: Optional[bool] = None) -> tuple[str, ...]:
    """Names of the registered ops, in table order, optionally of some ``kinds`` only and
    / or only the (non-)tunable ones."""
    wanted = None if kinds is None else set(kinds)
    bad = sorted(wanted - set(KINDS)) if wanted is not None else []
    if bad:
        raise ValueError(f"unknown op kind(s) {bad}; choose from {', '.join(KINDS)}.")
    return tuple(op.name for op in BENCH_OPS.values()
                 if (wanted is None or op.kind in wanted)
                 and (tunable is None or op.tunable == tunable))


def get_op(name: str) -> BenchOp:
    """The op called ``name``; ``ValueError`` naming the known ops otherwise."""
    try:
        return BENCH_OPS[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown op {name!r}; choose from {', '.join(BENCH_OPS)}.") from None


def launcher(name: str):
    """The Triton launcher ``tune`` times for op ``name`` (imports ``hisparse_triton.kernels``:
    torch and Triton)."""
    import importlib

    op = get_op(name)
    if op.launcher is None:
        raise ValueError(f"op {name!r} has no tunable launcher; tunable ops: "
                         f"{', '.join(TUNABLE_OPS)}.")
    module, function = op.launcher.split(":")
    return getattr(importlib.import_module(f"hisparse_triton.kernels.{module}"), function)


ROW_OPS = op_names(kinds=("rows",))
PAGE_OPS = op_names(kinds=("pages",))
TRANSFER_OPS = op_names(kinds=("rows", "pages"))
ALL_OPS = op_names()
TUNABLE_OPS = op_names(tunable=True)
#: Direction of each transfer op: ``"h2d"`` or ``"d2h"``.
DIRECTION = {op.name: op.direction for op in BENCH_OPS.values() if op.is_transfer}
#: Op groups the CLI's op lists accept besides op names.
GROUPS = {"rows": ROW_OPS, "pages": PAGE_OPS, "transfers": TRANSFER_OPS, "all": ALL_OPS}


def expand_ops(names: Iterable[str], allowed: tuple[str, ...]) -> tuple[str, ...]:
    """``names`` (op names or ``GROUPS`` names) as op names of ``allowed``, in order, without
    repeats; ``ValueError`` naming the first unknown name."""
    out: list[str] = []
    for name in names:
        members = GROUPS.get(name, (name,))
        members = tuple(m for m in members if m in allowed) if name in GROUPS else members
        for member in members:
            if member not in allowed:
                groups = [g for g in GROUPS if set(GROUPS[g]) & set(allowed)]
                raise ValueError(f"unknown {name!r}; choose from {', '.join(allowed)} "
                                 f"or a group: {', '.join(groups)}")
            if member not in out:
                out.append(member)
    return tuple(out)


__all__ = ["ALL_OPS", "BENCH_OPS", "BenchOp", "DIRECTION", "GROUPS", "KINDS", "PAGE_OPS",
           "ROW_OPS", "TRANSFER_OPS", "TUNABLE_OPS", "expand_ops", "get_op", "launcher",
           "op_names"]
