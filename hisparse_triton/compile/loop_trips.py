"""The cost model's inputs per kernel: loop trip counts and model twins (``sass_model``).

Static SASS counts a loop body once; the model repeats it ``trips`` times, with the trips
stated here per kernel (by its ``@triton.jit`` function name) as a function of one launch:
``LOOP_TRIPS[name](kernel, args, kwargs, grid) -> {for-statement text: trips}``, matched
against the kernel's source lines (``sass_model.loop_lines``). A kernel whose rare path (a
fallback) is compiled out for the model has a *twin*: ``MODEL_TWINS[name](kwargs)``, the
launch keywords the model compiles instead of the launch's own. Kernels without an entry
have no runtime loops worth counting (their hot loops are ``tl.static_range``) or no twin.
"""

from __future__ import annotations

from typing import Any, Callable

__all__ = ["LOOP_TRIPS", "MODEL_ROUNDS", "MODEL_TWINS"]

#: Insertion rounds the model assumes for the hash resolve (``kernels/resolve_hash.py``): a
#: Python simulation of the parallel rounds on 2,048 random or block-contiguous host rows
#: at load 1/16 gives a median of 3 (p95 4, max 5 of 200 rows).
MODEL_ROUNDS = 3


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
    state rows, ``MODEL_ROUNDS`` insertion rounds, one pass of lookup probes (the sorted
    fallback's loops do not run: the model twin has none)."""
    values = _values(kernel, args, kwargs)
    rows = int(grid[0]) if grid else 1
    return {
        "for r0 in range(0, r, BLOCK_R)": -(-(rows - 1) // values["BLOCK_R"]),
        "while (n_pend > 0) & (rounds < PROBES)": max(1, MODEL_ROUNDS
                                                      - values["FIRST_ROUNDS"]),
        "for d0 in range(0, rounds, LOOKUP)": -(-MODEL_ROUNDS // values["LOOKUP"]),
    }


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


def hash_resolve_twin(kwargs: dict) -> dict:
    """The hash resolve's model twin: the hash path alone (``FALLBACK=False``; the fallback
    runs only on overflow and costs the sorted figure)."""
    return {**kwargs, "FALLBACK": False}


#: Loop trips per kernel function name (see the module docstring).
LOOP_TRIPS: dict[str, Callable[[Any, tuple, dict, Any], dict[str, int]]] = {
    "_resolve_kernel": sorted_resolve_trips,
    "_resolve_hash_kernel": hash_resolve_trips,
    "_upconvert_kernel": upconvert_trips,
    "_swap_in_resolve_kernel": sglang_resolve_trips,
    "_copy_planned_kernel": sglang_copy_trips,
}
#: Model twins per kernel function name (see the module docstring).
MODEL_TWINS: dict[str, Callable[[dict], dict]] = {
    "_resolve_hash_kernel": hash_resolve_twin,
}
