"""``hisparse-triton plan``: show where every KV-cache group lives and how much fits.

Builds a preset's ``kv_cache_spec``, runs the planner (``hisparse_triton.layout``) and prints
the groups, both pool sizes, what row-aligned blocks cost, bytes per token and the
steady-state concurrency against the all-GPU baseline; ``--json PATH|-`` writes the same as
one JSON document (schema ``hisparse-triton/plan``). Imports no torch.
"""

from __future__ import annotations

import argparse
import math
import sys
import textwrap
import warnings
from typing import Any, Callable, Optional

from hisparse_triton.commands.argtypes import bounded_int, bounded_number, positive_int
from hisparse_triton.commands.output import add_json_flag, json_document, write_json
from hisparse_triton.config import (
    ACTIVE_TAIL_PAGES,
    GIB,
    MAX_DEVICE_BUFFER_SIZE,
    EngineConfig,
    HiSparseConfig,
)
from hisparse_triton.layout import (
    HiSparsePlanWarning,
    admission_blocks_per_request,
    device_bytes_per_block,
    get_all_gpu_baseline_concurrency,
    get_all_gpu_bytes_per_request,
    get_hisparse_concurrency,
    get_hisparse_kv_cache_config,
    get_hisparse_kv_cache_groups,
    group_kind,
    steady_blocks_per_request,
)
from hisparse_triton.presets import DEFAULT_PRESET, build_kv_cache_spec, get_preset, list_presets
from hisparse_triton.specs import HiSparseTopology, cdiv
from hisparse_triton.staging import PrefillStaging, chunk_rows, largest_group_row_bytes

DEFAULT_GPU_MEMORY_GIB = 80.0
DEFAULT_HOST_POOL_GIB = 256.0

#: Version of the ``--json`` document (``schema_version``).
PLAN_SCHEMA_VERSION = 1

#: Plausible ranges of the numeric flags (a value outside is a typo or the wrong unit).
MIN_GIB = 1e-6
MAX_GPU_MEMORY_GIB = 4096.0
MAX_HOST_POOL_GIB = 65536.0
MAX_PARALLEL_SIZE = 1024
MAX_NODES = 4096
MAX_BATCHED_TOKENS = 1 << 24


def _gib_type(high: float) -> Callable[[str], float]:
    """A GiB amount in ``[MIN_GIB, high]``; a value above ``high`` is called out as bytes."""
    check = bounded_number(MIN_GIB, high, " GiB")

    def parse(text: str) -> float:
        try:
            return check(text)
        except argparse.ArgumentTypeError as exc:
            try:
                too_big = float(text) > high
            except ValueError:
                too_big = False
            if too_big:
                raise argparse.ArgumentTypeError(
                    f"{exc} (a value this large is surely bytes; the flag takes GiB)") from None
            raise

    return parse


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
    parser.add_argument("--gpu-memory-gib", type=_gib_type(MAX_GPU_MEMORY_GIB),
                        default=DEFAULT_GPU_MEMORY_GIB, metavar="GIB",
                        help=f"GPU memory for the KV cache in GiB "
                             f"(default {DEFAULT_GPU_MEMORY_GIB:g})")
    parser.add_argument("--host-pool-gib", type=_gib_type(MAX_HOST_POOL_GIB),
                        default=DEFAULT_HOST_POOL_GIB, metavar="GIB",
                        help=f"pinned host pool in GiB (default {DEFAULT_HOST_POOL_GIB:g})")
    parser.add_argument("--top-k", dest="top_k", metavar="N",
                        type=bounded_int(1, MAX_DEVICE_BUFFER_SIZE), default=None,
                        help="rows the indexer selects per query (default: the preset's)")
    parser.add_argument("--topk", dest="top_k", type=bounded_int(1, MAX_DEVICE_BUFFER_SIZE),
                        help=argparse.SUPPRESS)
    parser.add_argument("--device-buffer-size", metavar="ROWS",
                        type=bounded_int(1, MAX_DEVICE_BUFFER_SIZE, " rows"), default=None,
                        help="hot-buffer rows per request (default 2 x top-k)")
    parser.add_argument("--max-num-batched-tokens", metavar="N",
                        type=bounded_int(1, MAX_BATCHED_TOKENS, " tokens"), default=None,
                        help="tokens scheduled per step; a resident group then admits a "
                             "request with cdiv(N, block) pages (default: unset, a whole "
                             "prompt per step)")
    parser.add_argument("--max-concurrent-batches", metavar="N",
                        type=bounded_int(1, MAX_PARALLEL_SIZE), default=1,
                        help="steps in flight at once, each holding up to "
                             "--max-num-batched-tokens (vLLM: 2 with async scheduling, the "
                             "pipeline depth with pipeline parallelism; default 1)")
    parser.add_argument("--prefill-staging-rows", metavar="N",
                        type=bounded_int(0, MAX_BATCHED_TOKENS, " rows"), default=0,
                        help="reserve a region of N rows at the end of the device pool for "
                             "prefill staging (default 0: free blocks are lent for the step "
                             "that needs them)")
    parser.add_argument("--row-aligned-blocks", action="store_true",
                        help="round the device block up to a whole number of every sparse "
                             "layer's pages, so each sparse layer is a flat row array "
                             "(costs some blocks; the plan shows how many)")
    parser.add_argument("--tp", type=bounded_int(1, MAX_PARALLEL_SIZE), default=1,
                        help="tensor-parallel ranks (default 1)")
    parser.add_argument("--pp", type=bounded_int(1, MAX_PARALLEL_SIZE), default=1,
                        help="pipeline-parallel stages (default 1)")
    parser.add_argument("--nodes", type=bounded_int(1, MAX_NODES), default=1,
                        help="machines the ranks span (default 1)")
    parser.add_argument("--shared-host-pool", action=argparse.BooleanOptionalAction,
                        default=None,
                        help="one host pool for all TP ranks of the node (default: on when "
                             "--tp > 1 on one node without pipeline parallelism)")
    add_json_flag(parser, "the plan")
    return parser


def _topology_json(topology: HiSparseTopology) -> dict[str, Any]:
    return {
        "source_group": topology.source_group,
        "indexer_group": topology.indexer_group,
        "resident_groups": list(topology.resident_groups),
        "hot_groups": list(topology.hot_groups),
        "regular_groups": list(topology.regular_groups),
        "index_groups": [{"leader": g.leader, "layers": list(g.layers),
                          "resident_group": g.resident_group, "hot_group": g.hot_group}
                         for g in topology.index_groups],
    }


def _row_alignment(groups: list, gpu_bytes: int) -> dict[str, Any]:
    """What rounding the block up to whole sparse pages costs (or would cost)."""
    plain = device_bytes_per_block(groups)
    aligned = device_bytes_per_block(groups, row_aligned_blocks=True)
    plain_blocks = gpu_bytes // plain
    aligned_blocks = gpu_bytes // aligned
    rows = sorted({g.layer_page_size_bytes // g.block_size for g in groups
                   if group_kind(g) == "resident"})
    return {
        "bytes_per_block": aligned,
        "num_gpu_blocks": aligned_blocks,
        "unaligned_bytes_per_block": plain,
        "unaligned_num_gpu_blocks": plain_blocks,
        "padding_bytes_per_block": aligned - plain,
        "blocks_lost": plain_blocks - aligned_blocks,
        "fraction_lost": (plain_blocks - aligned_blocks) / plain_blocks if plain_blocks else 0.0,
        "rows_per_block": [{"row_bytes": r, "rows_per_block": aligned // r} for r in rows],
    }


def _prefill_staging(config: EngineConfig, kv: Any) -> dict[str, Any]:
    """What prefill staging takes: the reserved region (if any), and what one chunk of one
    request can stage: its rows, the pool blocks they take (lent for the chunk's step, or
    the region's), the bytes the call writes (the largest index group's pages) and the
    worker's workspace."""
    staging = PrefillStaging.from_plan(kv, config)
    B = staging.block_size
    rows = chunk_rows(config)
    row_bytes = largest_group_row_bytes(kv)
    host_rows = kv.hisparse_host_num_blocks * B
    return {
        "mode": "lent" if staging.lent else "reserved",
        "reserved_rows": staging.capacity_rows,
        "reserved_blocks": staging.num_blocks,
        "reserved_bytes": staging.nbytes(kv.bytes_per_block),
        "chunk_rows": rows,
        "chunk_blocks": cdiv(rows, B),
        "chunk_bytes": cdiv(rows, B) * kv.bytes_per_block,
        "group_row_bytes": row_bytes,
        "chunk_written_bytes": rows * row_bytes,
        "workspace_bytes": 4 * host_rows + 8 * max(rows, staging.capacity_rows),
    }


def build_plan(preset: str = DEFAULT_PRESET, *, max_model_len: Optional[int] = None,
               gpu_memory_gib: float = DEFAULT_GPU_MEMORY_GIB,
               host_pool_gib: float = DEFAULT_HOST_POOL_GIB,
               device_buffer_size: Optional[int] = None, tp: int = 1,
               shared_host_pool: Optional[bool] = None, pp: int = 1, nodes: int = 1,
               max_num_batched_tokens: Optional[int] = None,
               max_concurrent_batches: int = 1,
               row_aligned_blocks: bool = False,
               top_k: Optional[int] = None,
               prefill_staging_rows: int = 0) -> dict[str, Any]:
    """Plan a preset; returns the report ``--json`` writes (without the schema envelope).

    ``ValueError`` (one sentence) for an invalid configuration or a plan that does not fit.
    Planner warnings (:class:`HiSparsePlanWarning`) land in the report's ``warnings``.
    """
    geometry = get_preset(preset)
    if max_model_len is not None and max_model_len > geometry.max_model_len:
        raise ValueError(f"max_model_len {max_model_len:,} exceeds the {preset} preset's max "
                         f"context of {geometry.max_model_len:,} tokens.")
    if not (gpu_memory_gib > 0 and math.isfinite(gpu_memory_gib * GIB)):
        raise ValueError(f"gpu_memory_gib must be a finite number > 0, got {gpu_memory_gib!r}.")
    hisparse = HiSparseConfig(index_topk=top_k or geometry.index_topk,
                              device_buffer_size=device_buffer_size,
                              host_pool_gib=host_pool_gib, shared_host_pool=shared_host_pool,
                              prefill_staging_rows=prefill_staging_rows)
    config = EngineConfig(max_model_len=max_model_len or geometry.max_model_len,
                          hisparse=hisparse, tensor_parallel_size=tp,
                          pipeline_parallel_size=pp, num_nodes=nodes,
                          max_num_batched_tokens=max_num_batched_tokens,
                          max_concurrent_batches=max_concurrent_batches)
    spec = build_kv_cache_spec(geometry)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", HiSparsePlanWarning)
        groups = get_hisparse_kv_cache_groups(config, spec)
    notes = [str(w.message) for w in caught if issubclass(w.category, HiSparsePlanWarning)]
    for w in caught:
        if not issubclass(w.category, HiSparsePlanWarning):  # pragma: no cover
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
    assert groups is not None  # presets always have SPARSE and INDEXER layers
    gpu_bytes = int(gpu_memory_gib * GIB)
    kv = get_hisparse_kv_cache_config(config, groups, gpu_bytes, hisparse.host_pool_bytes,
                                      row_aligned_blocks=row_aligned_blocks)
    topology = kv.hisparse_topology
    assert topology is not None
    conc = get_hisparse_concurrency(config, kv)
    baseline = get_all_gpu_baseline_concurrency(config, spec, gpu_bytes)
    pair = {**dict(zip(topology.resident_groups, topology.hot_groups)),
            **dict(zip(topology.hot_groups, topology.resident_groups))}

    block = geometry.block_size
    group_rows = []
    host_per_token = device_per_token = 0
    for index, group in enumerate(kv.kv_cache_groups):
        kind = topology.kind_of(index).value
        steady = 0 if group.host_resident else steady_blocks_per_request(config, group)
        if kind == "source":
            host_per_token += group.page_size_bytes // block
        elif kind in ("indexer", "regular"):
            device_per_token += group.page_size_bytes // group.block_size
        group_rows.append({
            "index": index, "role": kind, "group_role": group.role.value,
            "layers": len(group.layer_names), "layer_names": list(group.layer_names),
            "page_size_bytes": group.page_size_bytes, "host_resident": group.host_resident,
            "blocks_per_request": admission_blocks_per_request(config, group),
            "steady_blocks_per_request": steady,
            "paired_group": pair.get(index),
        })
    bpb = kv.bytes_per_block
    alignment = _row_alignment(list(kv.kv_cache_groups), gpu_bytes)
    return {
        "preset": geometry.name,
        "description": geometry.description,
        "max_model_len": config.max_model_len,
        "block_size": block,
        "index_topk": hisparse.index_topk,
        "device_buffer_size": hisparse.device_buffer_size,
        "max_num_batched_tokens": config.max_num_batched_tokens,
        "max_concurrent_batches": config.max_concurrent_batches,
        "in_flight_tokens": config.in_flight_tokens,
        "tensor_parallel_size": tp,
        "pipeline_parallel_size": pp,
        "num_nodes": nodes,
        "shared_host_pool": kv.hisparse_shared_host_pool,
        "gpu_memory_bytes": gpu_bytes,
        "host_pool_budget_bytes": hisparse.host_pool_bytes,
        "host_num_blocks": kv.hisparse_host_num_blocks,
        "host_block_stride": kv.hisparse_host_block_stride,
        "host_pool_bytes": kv.hisparse_host_num_blocks * kv.hisparse_host_block_stride,
        "num_gpu_blocks": kv.num_blocks,
        "bytes_per_block": bpb,
        "row_aligned_blocks": kv.row_aligned_blocks,
        "row_alignment": alignment,
        "device_pool_bytes": kv.num_blocks * bpb,
        "groups": group_rows,
        "topology": _topology_json(topology),
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
        "prefill_staging": _prefill_staging(config, kv),
        "warnings": notes,
    }


def _gib(num_bytes: int) -> str:
    """``num_bytes`` in the largest binary unit that keeps it >= 1 (``6.11 GiB``)."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:,.0f} B" if unit == "B" else f"{value:,.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")  # pragma: no cover


def _alignment_lines(r: dict[str, Any]) -> list[str]:
    a = r["row_alignment"]
    rows = ", ".join(f"{x['rows_per_block']:,} rows of {x['row_bytes']:,} B"
                     for x in a["rows_per_block"])
    head = ("  row-aligned  on: " if r["row_aligned_blocks"]
            else "  row-aligned  off; --row-aligned-blocks: ")
    return [f"{head}{a['unaligned_bytes_per_block']:,} -> {a['bytes_per_block']:,} B per "
            f"block ({rows}),",
            f"               {a['blocks_lost']:,} fewer blocks ({a['fraction_lost']:.1%}) than "
            f"unaligned"]


def _staging_lines(r: dict[str, Any]) -> list[str]:
    p = r["prefill_staging"]
    rows = f"{p['chunk_rows']:,} rows"
    if p["mode"] == "lent":
        first = "staging rows lent per step (--prefill-staging-rows 0); a chunk of one request"
        second = (f"stages up to {rows}: {p['chunk_blocks']:,} blocks = "
                  f"{_gib(p['chunk_bytes'])} lent for its step;")
    else:
        first = (f"staging region of {p['reserved_rows']:,} rows = {p['reserved_blocks']:,} "
                 f"blocks = {_gib(p['reserved_bytes'])} reserved (end of the pool)")
        fits = "it holds" if p["reserved_rows"] >= p["chunk_rows"] else "more than it holds"
        second = f"a chunk of one request stages up to {rows} ({fits});"
    return [f"  prefill      {first}",
            f"               {second}",
            f"               a call writes {_gib(p['chunk_written_bytes'])} of it (its index "
            f"group's pages, {p['group_row_bytes']:,} B a row; a block holds",
            f"               every layer's page); worker workspace "
            f"{_gib(p['workspace_bytes'])}"]


def format_plan(report: dict[str, Any]) -> str:
    """The human-readable form of a :func:`build_plan` report."""
    r = report
    tp = r["tensor_parallel_size"]
    if r["shared_host_pool"]:
        sharing = f"one pool shared by {tp} TP rank{'s' if tp > 1 else ''}"
    else:
        sharing = "per TP rank" if tp > 1 else "private"
    batched = r["max_num_batched_tokens"]
    batches = r["max_concurrent_batches"]
    if batched is None:
        in_flight = "unset (a whole prompt per step)"
    elif batches == 1:
        in_flight = f"{batched:,} (a resident group admits a request with the pages of one step)"
    else:
        in_flight = (f"{batched:,} x {batches} batches in flight = {r['in_flight_tokens']:,} "
                     f"tokens (a resident group admits a request with the pages of {batches} "
                     f"steps)")
    lines = [
        f"HiSparse plan: {r['preset']} ({r['description']})",
        f"  max_model_len {r['max_model_len']:,} tokens, block {r['block_size']}, "
        f"index_topk {r['index_topk']:,}, device_buffer_size {r['device_buffer_size']:,} rows, "
        f"TP {tp}, PP {r['pipeline_parallel_size']}, nodes {r['num_nodes']}",
        f"  max_num_batched_tokens {in_flight}",
    ]
    lines += [textwrap.fill(note, width=100, initial_indent="  warning: ",
                            subsequent_indent="           ") for note in r["warnings"]]
    lines += [
        "",
        f"  {'#':>3}  {'role':<9} {'layers':>6} {'page bytes':>12} {'blocks/req':>11} "
        f"{'steady':>7} {'pair':>5}  where",
    ]
    for g in r["groups"]:
        where = "host (pinned)" if g["host_resident"] else "gpu"
        steady = "-" if g["host_resident"] else f"{g['steady_blocks_per_request']:,}"
        pair = "-" if g["paired_group"] is None else str(g["paired_group"])
        lines.append(f"  {g['index']:>3}  {g['role']:<9} {g['layers']:>6} "
                     f"{g['page_size_bytes']:>12,} {g['blocks_per_request']:>11,} "
                     f"{steady:>7} {pair:>5}  {where}")
    lines += [
        "",
        f"  host pool    {r['host_num_blocks']:,} blocks x {r['host_block_stride']:,} B = "
        f"{_gib(r['host_pool_bytes'])} ({sharing}; budget {_gib(r['host_pool_budget_bytes'])})",
        f"  device pool  {r['num_gpu_blocks']:,} blocks x {r['bytes_per_block']:,} B = "
        f"{_gib(r['device_pool_bytes'])} (one pool for all GPU groups)",
        *_alignment_lines(r),
        f"  bytes/token  host {r['host_bytes_per_token']:,} B (sparse MLA), device "
        f"{r['device_bytes_per_token']:,} B (indexer + regular), all-GPU "
        f"{r['all_gpu_bytes_per_token']:,} B",
        f"  per request  host {_gib(r['host_bytes_per_request'])}, GPU "
        f"{_gib(r['device_bytes_per_request_admission'])} at admission, "
        f"{_gib(r['device_bytes_per_request_steady'])} at steady state "
        f"(all-GPU {_gib(r['all_gpu_bytes_per_request'])})",
        "  why more fit: the sparse-MLA history lives in pinned host memory; per request the "
        "GPU keeps",
        f"  only the indexer cache, its newest {ACTIVE_TAIL_PAGES} pages (resident tail) and "
        f"{r['device_buffer_size']:,} hot-buffer rows.",
        *_staging_lines(r),
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
    """Plan and print: the human report, and the JSON document with ``--json``.

    ``--json -`` (or a bare ``--json``) prints only the JSON document on stdout (it holds
    everything the human report shows); ``--json PATH`` writes it and prints the report.
    """
    report = build_plan(args.preset, max_model_len=args.max_model_len,
                        gpu_memory_gib=args.gpu_memory_gib, host_pool_gib=args.host_pool_gib,
                        device_buffer_size=args.device_buffer_size, tp=args.tp,
                        shared_host_pool=args.shared_host_pool, pp=args.pp, nodes=args.nodes,
                        max_num_batched_tokens=args.max_num_batched_tokens,
                        max_concurrent_batches=args.max_concurrent_batches,
                        row_aligned_blocks=args.row_aligned_blocks, top_k=args.top_k,
                        prefill_staging_rows=args.prefill_staging_rows)
    if args.json is not None:
        write_json(json_document("plan", PLAN_SCHEMA_VERSION, report), args.json)
    if args.json != "-":
        print(format_plan(report), file=sys.stdout)
    return 0
