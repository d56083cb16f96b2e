"""Launch configs of the transfer kernels and the one lookup the launchers call.

Every row/page copy (``gather``, ``backup``, ``restore``, ``spill``: one shared kernel,
``hisparse_triton.kernels.gather.copy_rows_kernel``) is launched with a ``CopyConfig``. The
launchers never build one themselves: they call ``default_config(kernel, row_bytes,
num_layers)``, the single lookup: the per-device tuned cache (``tuning_cache``, read once at
first use) first, then the built-in defaults below (``builtin_config``).

Built-in defaults (``row_bytes`` = bytes one plan entry moves: a row for ``gather``/``backup``,
a whole page, ``block_size * row_bytes``, for ``restore``/``spill``):

| kernel | rows_per_program | layers_per_program | chunk_bytes | num_warps |
| --- | --- | --- | --- | --- |
| gather, backup | ``max(8, 4096 // chunk)`` (8 for 656 B rows, 256 for 16 B) | 1 (gather), 4 (backup) | ``min(1024, next_pow2(row_bytes))`` | 4 |
| restore, spill | 1 | 1 | 4096 | 4 |

``access_bytes = 16`` (one 16-byte access per thread; the launcher narrows it to the alignment
of the rows actually addressed), ``num_stages = 1``, ``grid_programs = 0``: the grid is capped
at 32 programs per SM of the device the launch runs on (4,224 on a 132-SM H100 / H200; 132 SMs
are assumed where none can be queried). A bigger plan is walked grid-stride, so the grid width
is fixed once the plan outgrows it and never depends on the batch size otherwise than by being
smaller.

Tile limit: Triton refuses a block of more than ``2**20`` elements, and one copy step holds a
``[rows_per_program, chunk_bytes / word]`` tile of words (word = 1 byte at worst, for 1-byte
aligned tables), so a config must keep ``rows_per_program * chunk_bytes <= MAX_TILE_ELEMENTS``
(refused at construction, naming the limit).

This module imports nothing heavy (no torch, no triton; the cache lookup imports torch
lazily to name the device).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from math import gcd

from hisparse_triton import tuning_cache

#: Most elements of one Triton block (``triton.language.TRITON_MAX_TENSOR_NUMEL``).
MAX_TILE_ELEMENTS = 1 << 20
#: Widest top-k (columns per batch row) the resolve kernel accepts: the largest
#: ``device_buffer_size`` the config allows (speculative decoding resolves a union of Q x K
#: columns). Every width up to it compiles for sm_90 without spills (the compile report);
#: re-exported as ``hisparse_triton.kernels.resolve.MAX_RESOLVE_WIDTH``. Defined here so that
#: torch-free code (the planner's config validation) can import it.
MAX_RESOLVE_WIDTH = 32768
#: Kernel names ``default_config`` knows: row copies and whole-page copies, per direction.
ROW_KERNELS = ("gather", "backup")
PAGE_KERNELS = ("restore", "spill")


def _is_pow2(value: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0 \
        and value & (value - 1) == 0


def next_pow2(value: int) -> int:
    """Smallest power of two ``>= value`` (``value >= 1``)."""
    return 1 << (max(1, value) - 1).bit_length()


def pow2_alignment(*values: int, cap: int = 16) -> int:
    """Largest power of two ``<= cap`` dividing every value (0 divides by anything).

    ``pow2_alignment(656, 41984, 0) == 16``; ``pow2_alignment(132) == 4``.
    """
    g = 0
    for value in values:
        g = gcd(g, int(value))
    if g == 0:
        return cap
    return min(cap, g & -g)


@dataclass(frozen=True)
class CopyConfig:
    """How one row/page copy launch is shaped (positive ints; the tile sizes
    ``rows_per_program``, ``access_bytes``, ``chunk_bytes`` and ``num_warps`` powers of two).

    - ``rows_per_program``: plan columns (rows, or pages) one program moves per work item.
    - ``layers_per_program``: layers one program walks for each work item (grid axis 1 is
      ``cdiv(num_layers, layers_per_program)``).
    - ``access_bytes``: widest access per thread (16 = ``int32 x 4``); the launcher uses the
      largest width <= this that divides the row size, the block stride, every layer offset
      and both pools' base addresses.
    - ``chunk_bytes``: bytes of each row moved per inner-loop step (a ``[rows_per_program,
      chunk_bytes / 4]`` word tile).
    - ``num_warps``, ``num_stages``: Triton launch options.
    - ``grid_programs``: most programs of a launch (axis 0 x axis 1); work items beyond it are
      walked grid-stride by the same programs. ``0`` (the default): 32 per SM of the device.

    ``rows_per_program * chunk_bytes`` must not exceed ``MAX_TILE_ELEMENTS`` (Triton's block
    limit; a 1-byte word tile has ``chunk_bytes`` elements per row).
    """

    rows_per_program: int = 8
    layers_per_program: int = 1
    access_bytes: int = 16
    chunk_bytes: int = 1024
    num_warps: int = 4
    num_stages: int = 1
    grid_programs: int = 0

    def __post_init__(self) -> None:
        for name in ("rows_per_program", "access_bytes", "chunk_bytes", "num_warps"):
            value = getattr(self, name)
            if not _is_pow2(value):
                raise ValueError(f"CopyConfig.{name} must be a power of two, got {value!r}.")
        if self.access_bytes > 16:
            raise ValueError(f"CopyConfig.access_bytes must be <= 16, got {self.access_bytes}.")
        if self.chunk_bytes < self.access_bytes:
            raise ValueError(f"CopyConfig.chunk_bytes={self.chunk_bytes} is smaller than "
                             f"access_bytes={self.access_bytes}.")
        for name in ("layers_per_program", "num_stages", "grid_programs"):
            value = getattr(self, name)
            low = 0 if name == "grid_programs" else 1
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                what = "an int >= 0 (0 = per SM)" if low == 0 else "a positive int"
                raise ValueError(f"CopyConfig.{name} must be {what}, got {value!r}.")
        tile = self.rows_per_program * self.chunk_bytes
        if tile > MAX_TILE_ELEMENTS:
            raise ValueError(f"CopyConfig: rows_per_program * chunk_bytes = "
                             f"{self.rows_per_program} * {self.chunk_bytes} = {tile} exceeds "
                             f"Triton's block limit MAX_TILE_ELEMENTS = {MAX_TILE_ELEMENTS} "
                             f"(a tile of 1-byte words).")


@lru_cache(maxsize=256)
def default_config(kernel: str, row_bytes: int, num_layers: int) -> CopyConfig:
    """The launch config of ``kernel`` for plan entries of ``row_bytes`` bytes (a row for
    ``gather``/``backup``, a page for ``restore``/``spill``) and ``num_layers`` layers per
    launch: the per-device tuned entry (``tuning_cache.lookup_config``, written by
    ``hisparse-triton tune``) when there is one, else ``builtin_config``.

    The one lookup every launcher makes. Memoised (``default_config.cache_clear()`` after the
    cache file changes); raises ``ValueError`` for an unknown kernel or a bad size.
    """
    builtin = builtin_config(kernel, row_bytes, num_layers)
    tuned = tuning_cache.lookup_config(CopyConfig, kernel, row_bytes, num_layers)
    return tuned if tuned is not None else builtin


@lru_cache(maxsize=256)
def builtin_config(kernel: str, row_bytes: int, num_layers: int) -> CopyConfig:
    """The built-in default of ``kernel`` (the table in the module docstring).

    ``kernel``: one of ``ROW_KERNELS + PAGE_KERNELS``.
    """
    if not isinstance(row_bytes, int) or row_bytes <= 0:
        raise ValueError(f"default_config: row_bytes must be a positive int, got {row_bytes!r}.")
    if not isinstance(num_layers, int) or num_layers <= 0:
        raise ValueError(f"default_config: num_layers must be a positive int, "
                         f"got {num_layers!r}.")
    if kernel in ROW_KERNELS:
        chunk = min(1024, next_pow2(row_bytes))
        return CopyConfig(
            rows_per_program=max(8, 4096 // chunk),
            # backup mirrors a few new rows into every source layer (61-78): split layers
            # over the grid, but give each program several so the plan loads are shared.
            layers_per_program=1 if kernel == "gather" else min(4, next_pow2(num_layers)),
            chunk_bytes=max(16, chunk),
        )
    if kernel in PAGE_KERNELS:
        return CopyConfig(rows_per_program=1, layers_per_program=1, chunk_bytes=4096)
    raise ValueError(f"default_config: unknown kernel {kernel!r}; expected one of "
                     f"{', '.join(ROW_KERNELS + PAGE_KERNELS)}.")
