"""The cost model's inputs per kernel: loop trip counts (``sass_model``).

Static SASS counts a loop body once; the model repeats it ``trips`` times, with the trips
stated here per kernel (by its ``@triton.jit`` function name) as a function of one launch:
``LOOP_TRIPS[name](kernel, args, kwargs, grid) -> {for-statement text: trips}``, matched
against the kernel's source lines (``sass_model.loop_lines``). Kernels without an entry have
no runtime loops worth counting (their hot loops are ``tl.static_range``). The model
compiles every launch as the runtime makes it (no twin with a path compiled out). Two more
tables say which path a launch's figures count (the model dict's ``path``):
``EARLY_EXITS[name](kwargs)`` is true for a launch whose programs, in a realistic batch, all
take the kernel's early return (the hash resolve's fallback launch: no row flagged), costed
to its first ``EXIT`` with the full path beside it; ``MODEL_PATHS[name](kwargs)`` describes
the path of the other launches where it needs saying.
"""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["EARLY_EXITS", "LOOP_TRIPS", "MODEL_PATHS"]


def _values(kernel: Any, args: tuple, kwargs: dict) -> dict:
    values = dict(zip(kernel.arg_names, args))
    values.update(kwargs)
    return values


def sorted_resolve_trips(kernel: Any, args: tuple, kwargs: dict, grid: Any) -> dict[str, int]:
    """``_resolve_kernel`` (``kernels/resolve_sorted.py``): the slowest program's loops (the
    last row, which scans every earlier state row)."""
    values = _values(kernel, args, kwargs)
    K, H = int(values["K"]), int(values["H"])
    rows = int(grid[0]) if grid else 1
    block_k, sort, block_h = values["BLOCK_K"], values["SORT"], values["BLOCK_H"]
    return {
        "for r0 in range(0, r, BLOCK_R)": -(-(rows - 1) // values["BLOCK_R"]),
        "for h0 in range(0, H, BLOCK_H)": -(-H // block_h),
        "for c0 in range(0, K, SORT)": -(-K // sort),
        "in range(0, BLOCK_K, SORT)": block_k // sort,
    }


def hash_resolve_trips(kernel: Any, args: tuple, kwargs: dict, grid: Any) -> dict[str, int]:
    """``_resolve_hash_kernel`` (``kernels/resolve_hash.py``): the last row's scan of earlier
    state rows. Its only other data-dependent work, the insertion, is one ``atomic_add`` per
    column and its lookups a fixed ``PROBES`` loads (``tl.static_range``): the same for every
    row, the slowest of a batch included (``compile/insertion.py`` simulates how full the
    buckets get)."""
    values = _values(kernel, args, kwargs)
    rows = int(grid[0]) if grid else 1
    return {"for r0 in range(0, r, BLOCK_R)": -(-(rows - 1) // values["BLOCK_R"])}


def upconvert_trips(kernel: Any, args: tuple, kwargs: dict, grid: Any) -> dict[str, int]:
    """``_upconvert_kernel`` (``kernels/vllm_fp8.py``): the scan of ``workspace_starts`` in
    ``BLOCK_B`` requests."""
    values = _values(kernel, args, kwargs)
    trips = -(-int(values["batch"]) // values["BLOCK_B"])
    return {"for q0 in range(0, batch, BLOCK_B)": max(1, trips)}


def sglang_resolve_trips(kernel: Any, args: tuple, kwargs: dict, grid: Any
                         ) -> dict[str, int]:
    """``_swap_in_resolve_kernel`` (``kernels/sglang_swap_in.py``): its LRU tiles."""
    values = _values(kernel, args, kwargs)
    return {"for h0 in range(0, H, BLOCK_H)": -(-int(values["H"]) // values["BLOCK_H"])}


def sglang_copy_trips(kernel: Any, args: tuple, kwargs: dict, grid: Any) -> dict[str, int]:
    """``_copy_planned_kernel`` (``kernels/sglang_swap_in.py``): the busiest program's items
    (a grid-stride loop) and the chunks of one row."""
    values = _values(kernel, args, kwargs)
    programs = int(grid[0]) if grid else 1
    return {
        "for item in range(tl.program_id(0), num_items, tl.num_programs(0))":
            -(-int(values["num_items"]) // programs),
        "for w0 in range(0, row_words, CHUNK)": -(-int(values["row_words"]) // values["CHUNK"]),
    }


#: Loop trips per kernel function name (see the module docstring).
LOOP_TRIPS: dict[str, Callable[[Any, tuple, dict, Any], dict[str, int]]] = {
    "_resolve_kernel": sorted_resolve_trips,
    "_resolve_hash_kernel": hash_resolve_trips,
    "_upconvert_kernel": upconvert_trips,
    "_swap_in_resolve_kernel": sglang_resolve_trips,
    "_copy_planned_kernel": sglang_copy_trips,
}


def hash_resolve_path(kwargs: dict) -> str:
    """What the hash resolve's model counts."""
    return ("an unflagged row, the slowest of the grid: one insertion round per column (an "
            f"atomic_add on its bucket, whatever the keys), {kwargs.get('PROBES')} lookup "
            "probes (static), the last row's scan of earlier state rows, every forward "
            "branch counted")


#: Launches whose programs all take the early return in a realistic batch (see the module
#: docstring): the sorted kernel as the hash resolve's fallback launch.
EARLY_EXITS: dict[str, Callable[[dict], bool]] = {
    "_resolve_kernel": lambda kwargs: bool(kwargs.get("FLAGGED", False)),
}
#: The path a launch's model counts, where the default ("every branch taken") needs saying.
MODEL_PATHS: dict[str, Callable[[dict], str]] = {
    "_resolve_hash_kernel": hash_resolve_path,
}
