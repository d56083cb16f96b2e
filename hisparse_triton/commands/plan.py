"""``hisparse-triton plan``: show where every KV-cache group lives and how much fits.

Builds a preset's ``kv_cache_spec``, runs the planner (``hisparse_triton.layout``) and prints
the groups, both pool sizes, bytes per token and the steady-state concurrency against the
all-GPU baseline; ``--json`` prints the same as one JSON object. Imports no torch.
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Any, Optional

from hisparse_triton.commands.argtypes import positive_float, positive_int
from hisparse_triton.config import GIB, EngineConfig, HiSparseConfig
from hisparse_triton.layout import (
    get_all_gpu_baseline_concurrency,
    get_all_gpu_bytes_per_request,
    get_hisparse_concurrency,
    get_hisparse_kv_cache_config,
    get_hisparse_kv_cache_groups,
    group_kind,
    steady_blocks_per_request,
)
from hisparse_triton.presets import DEFAULT_PRESET, build_kv_cache_spec, get_preset, list_presets

DEFAULT_GPU_MEMORY_GIB = 80.0
DEFAULT_HOST_POOL_GIB = 256.0




def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``plan`` and its flags."""
    parser = subparsers.add_parser(
        "plan", help="show the HiSparse layout plan for a model preset",
        description="Plan the HiSparse layout of a built-in model geometry: groups, host and "
                    "device pool sizes, and how many max-length requests fit.")
    parser.add_argument("--preset", default=DEFAULT_PRESET, choices=list_presets(),
                        help=f"model geometry (default {DEFAULT_PRESET})")
    parser.add_argument("--max-model-len", type=positive_int, default=None,
                        help="tokens per request (default: the preset's max context)")
    parser.add_argument("--gpu-memory-gib", type=positive_float,
                        default=DEFAULT_GPU_MEMORY_GIB,
                        help=f"GPU memory for the KV cache in GiB "
                             f"(default {DEFAULT_GPU_MEMORY_GIB:g})")
    parser.add_argument("--host-pool-gib", type=positive_float, default=DEFAULT_HOST_POOL_GIB,
                        help=f"pinned host pool in GiB (default {DEFAULT_HOST_POOL_GIB:g})")
    parser.add_argument("--device-buffer-size", type=positive_int, default=None,
                        help="hot-buffer rows per request (default 2 x index_topk)")
    parser.add_argument("--tp", type=positive_int, default=1,
                        help="tensor-parallel ranks per node (default 1)")
    parser.add_argument("--shared-host-pool", action=argparse.BooleanOptionalAction,
                        default=None,
                        help="one host pool for all TP ranks (default: on when --tp > 1)")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    return parser


def build_plan(preset: str = DEFAULT_PRESET, *, max_model_len: Optional[int] = None,
               gpu_memory_gib: float = DEFAULT_GPU_MEMORY_GIB,
               host_pool_gib: float = DEFAULT_HOST_POOL_GIB,
               device_buffer_size: Optional[int] = None, tp: int = 1,
               shared_host_pool: Optional[bool] = None) -> dict[str, Any]:
    """Plan a preset; returns the JSON-able report ``--json`` prints.

    ``ValueError`` (one sentence) for an invalid configuration or a plan that does not fit.
    """
    geometry = get_preset(preset)
    if max_model_len is not None and max_model_len > geometry.max_model_len:
        raise ValueError(f"max_model_len {max_model_len:,} exceeds the {preset} preset's max "
                         f"context of {geometry.max_model_len:,} tokens.")
    if not (gpu_memory_gib > 0 and math.isfinite(gpu_memory_gib * GIB)):
        raise ValueError(f"gpu_memory_gib must be a finite number > 0, got {gpu_memory_gib!r}.")
    hisparse = HiSparseConfig(index_topk=geometry.index_topk,
                              device_buffer_size=device_buffer_size,
                              host_pool_gib=host_pool_gib, shared_host_pool=shared_host_pool)
    config = EngineConfig(max_model_len=max_model_len or geometry.max_model_len,
                          hisparse=hisparse, tensor_parallel_size=tp)
    spec = build_kv_cache_spec(geometry)
    groups = get_hisparse_kv_cache_groups(config, spec)
    assert groups is not None  # presets always have SPARSE and INDEXER layers
    gpu_bytes = int(gpu_memory_gib * GIB)
    kv = get_hisparse_kv_cache_config(config, groups, gpu_bytes, hisparse.host_pool_bytes)
    conc = get_hisparse_concurrency(config, kv)
    baseline = get_all_gpu_baseline_concurrency(config, spec, gpu_bytes)

    block = geometry.block_size
    group_rows = []
    host_per_token = device_per_token = 0
    for index, group in enumerate(kv.kv_cache_groups):
        kind = group_kind(group)
        admit = group.blocks_per_request(config)
        steady = 0 if group.host_resident else steady_blocks_per_request(config, group)
        if kind == "source":
            host_per_token += group.page_size_bytes // block
        elif kind in ("indexer", "regular"):
            device_per_token += group.page_size_bytes // group.block_size
        group_rows.append({
            "index": index, "role": kind, "group_role": group.role.value,
            "layers": len(group.layer_names), "layer_names": list(group.layer_names),
            "page_size_bytes": group.page_size_bytes, "host_resident": group.host_resident,
            "blocks_per_request": admit,
            "steady_blocks_per_request": steady,
        })
    bpb = kv.bytes_per_block
    return {
        "preset": geometry.name,
        "description": geometry.description,
        "max_model_len": config.max_model_len,
        "block_size": block,
        "index_topk": hisparse.index_topk,
        "device_buffer_size": hisparse.device_buffer_size,
        "tensor_parallel_size": tp,
        "shared_host_pool": kv.hisparse_shared_host_pool,
        "gpu_memory_bytes": gpu_bytes,
        "host_pool_budget_bytes": hisparse.host_pool_bytes,
        "host_num_blocks": kv.hisparse_host_num_blocks,
        "host_block_stride": kv.hisparse_host_block_stride,
        "host_pool_bytes": kv.hisparse_host_num_blocks * kv.hisparse_host_block_stride,
        "num_gpu_blocks": kv.num_blocks,
        "bytes_per_block": bpb,
        "device_pool_bytes": kv.num_blocks * bpb,
        "groups": group_rows,
        "host_bytes_per_token": host_per_token,
        "device_bytes_per_token": device_per_token,
        "all_gpu_bytes_per_token": host_per_token + device_per_token,
        "host_blocks_per_request": conc.host_blocks_per_request,
        "admission_blocks_per_request": conc.admission_blocks,
        "steady_blocks_per_request": conc.steady_blocks,
        "host_bytes_per_request": conc.host_blocks_per_request * kv.hisparse_host_block_stride,
        "device_bytes_per_request_admission": conc.admission_blocks * bpb,
        "device_bytes_per_request_steady": conc.steady_blocks * bpb,
        "all_gpu_bytes_per_request": get_all_gpu_bytes_per_request(config, spec),
        "gpu_concurrency": conc.gpu,
        "host_concurrency": conc.host,
        "steady_state_concurrency": conc.steady_state,
        "limited_by": conc.limited_by,
        "baseline_concurrency": baseline,
        "concurrency_gain": conc.steady_state / baseline if baseline > 0 else None,
    }


def _gib(num_bytes: int) -> str:
    """``num_bytes`` in the largest binary unit that keeps it >= 1 (``6.11 GiB``)."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:,.0f} B" if unit == "B" else f"{value:,.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")  # pragma: no cover


def format_plan(report: dict[str, Any]) -> str:
    """The human-readable form of a :func:`build_plan` report."""
    r = report
    tp = r["tensor_parallel_size"]
    if r["shared_host_pool"]:
        sharing = f"one pool shared by {tp} TP rank{'s' if tp > 1 else ''}"
    else:
        sharing = "per TP rank" if tp > 1 else "private"
    lines = [
        f"HiSparse plan: {r['preset']} ({r['description']})",
        f"  max_model_len {r['max_model_len']:,} tokens, block {r['block_size']}, "
        f"index_topk {r['index_topk']:,}, device_buffer_size {r['device_buffer_size']:,} rows, "
        f"TP {tp}",
        "",
        f"  {'#':>3}  {'role':<9} {'layers':>6} {'page bytes':>12} {'blocks/req':>11} "
        f"{'steady':>7}  where",
    ]
    for g in r["groups"]:
        where = "host (pinned)" if g["host_resident"] else "gpu"
        steady = "-" if g["host_resident"] else f"{g['steady_blocks_per_request']:,}"
        lines.append(f"  {g['index']:>3}  {g['role']:<9} {g['layers']:>6} "
                     f"{g['page_size_bytes']:>12,} {g['blocks_per_request']:>11,} "
                     f"{steady:>7}  {where}")
    lines += [
        "",
        f"  host pool    {r['host_num_blocks']:,} blocks x {r['host_block_stride']:,} B = "
        f"{_gib(r['host_pool_bytes'])} ({sharing}; budget {_gib(r['host_pool_budget_bytes'])})",
        f"  device pool  {r['num_gpu_blocks']:,} blocks x {r['bytes_per_block']:,} B = "
        f"{_gib(r['device_pool_bytes'])} (one pool for all GPU groups)",
        f"  bytes/token  host {r['host_bytes_per_token']:,} B (sparse MLA), device "
        f"{r['device_bytes_per_token']:,} B (indexer + regular), all-GPU "
        f"{r['all_gpu_bytes_per_token']:,} B",
        f"  per request  host {_gib(r['host_bytes_per_request'])}, GPU "
        f"{_gib(r['device_bytes_per_request_admission'])} at admission, "
        f"{_gib(r['device_bytes_per_request_steady'])} at steady state "
        f"(all-GPU {_gib(r['all_gpu_bytes_per_request'])})",
        "",
        f"  requests at max length  HiSparse steady state {r['steady_state_concurrency']:,.1f} "
        f"(GPU {r['gpu_concurrency']:,.1f}, host {r['host_concurrency']:,.1f}: "
        f"{r['limited_by']}-limited)",
        f"                          all-GPU baseline      {r['baseline_concurrency']:,.1f}",
    ]
    if r["concurrency_gain"] is not None:
        lines.append(f"                          gain                  "
                     f"{r['concurrency_gain']:,.2f}x")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Plan and print (human table, or JSON with ``--json``)."""
    report = build_plan(args.preset, max_model_len=args.max_model_len,
                        gpu_memory_gib=args.gpu_memory_gib, host_pool_gib=args.host_pool_gib,
                        device_buffer_size=args.device_buffer_size, tp=args.tp,
                        shared_host_pool=args.shared_host_pool)
    print(json.dumps(report, indent=2) if args.json else format_plan(report))
    return 0
