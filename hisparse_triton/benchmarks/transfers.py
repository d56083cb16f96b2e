"""Transfer figures: gather / backup rows and restore / spill pages, every method.

Methods (``settings.METHODS``):

- ``triton``: ``ops.copy_rows`` / ``copy_pages`` with the Triton backend, timed with
  ``do_bench`` (one launch per call, the next plan of the rotation each time); on CUDA also
  ``triton_graph``: the whole rotation captured in one CUDA graph, time per call = replay
  time / rotation length (no Python launch cost);
- ``torch``: the same ops with the torch backend (``reference.py``), wall clock;
- ``eager`` (baseline): ``index_select`` of the rows out of the source pool (the pinned host
  pool for H2D) into a staging buffer, one ``copy_`` across the link, ``index_copy_`` into the
  destination pool, all layers at once with precomputed flat indices (favours eager), wall
  clock;
- ``contiguous`` (baseline, the link ceiling): one ``copy_`` of the same number of bytes
  between a contiguous pinned host buffer and device memory, ``do_bench``.

Bytes counted are payload only, ``rows x layers x row_bytes`` (pages: ``pages x 64 x layers x
row_bytes``), the same for every method. Before a method is timed its output is checked: the
destination rows of one plan (at most ``VERIFY_BYTES`` of them, sampled across the layers)
are overwritten with the complement of their expected bytes, the method runs once and the
rows are compared with the source rows.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from hisparse_triton.benchmarks.figures import Figure
from hisparse_triton.benchmarks.registry import DIRECTION, PAGE_OPS, ROW_OPS, TRANSFER_OPS
from hisparse_triton.benchmarks.settings import BASELINES, BLOCK_SIZE, GRAPH_METHOD, BenchSettings
from hisparse_triton.benchmarks.timing import (
    Measurer,
    Rotation,
    Timing,
    capture_graph,
    device_time,
    gbps,
    sync,
    wall_time,
)
from hisparse_triton.benchmarks.workloads import (
    Pools,
    RowPlans,
    alloc_host,
    device_flat_rows,
    host_flat_rows,
    make_page_plans,
    make_pools,
    make_row_plans,
    plan_geometry,
    plan_variants,
)
from hisparse_triton.row_table import RowTable

WRONG_BYTES = "moved rows differ from the source rows"
#: Most bytes one check compares: a larger plan is checked on a random sample of its units
#: (rows or pages, across the layers; the scribble covers the same sample).
VERIFY_BYTES = 64 << 20


def _ops() -> Any:
    from hisparse_triton import ops  # looked up at call time (tests patch it)

    return ops


def launch_config_source(op: str, span: int, layers: int) -> str:
    """``"tuned"`` when the launcher uses a tuned config (``tuning.default_config`` differs
    from the built-in one) for this op, span and layer count, else ``"builtin"``."""
    from hisparse_triton import tuning

    tuned = tuning.default_config(op, span, layers) != tuning.builtin_config(op, span, layers)
    return "tuned" if tuned else "builtin"


class TransferBench(Measurer):
    """Measures the transfer figures of one sweep (``BenchSettings``) on ``device``;
    ``step(note)`` is called after every figure (progress)."""

    s: BenchSettings

    def _time(self, fn: Callable[[], Any], *, host_part: bool) -> Timing:
        if self.cuda and not host_part:
            return self.watched(lambda: device_time(fn, warmup_ms=self.s.warmup_ms,
                                                    rep_ms=self.s.rep_ms))
        return self.watched(lambda: wall_time(fn, self.device, warmup_ms=self.s.warmup_ms,
                                              rep_ms=self.s.rep_ms, setup=self.flush))

    # ---- sweep

    def group(self, row_bytes: int, layers: int, out: list[Figure],
              on_case: Optional[Callable[[], None]] = None) -> None:
        """Append every figure of one (row size, layers) pair to ``out`` case by case (an
        interrupted run keeps them; ``on_case`` runs after each case); one pair of pools."""
        s = self.s
        ops = [op for op in s.ops if op in TRANSFER_OPS]
        rotate_rows = -(-s.rotate_bytes // (row_bytes * layers))
        pools = make_pools(row_bytes, layers, max(max(s.rows), rotate_rows), self.device,
                           seed=s.seed)
        for rows in s.rows:
            params = {"row_bytes": row_bytes, "rows": rows, "layers": layers}
            baseline: dict[tuple[Any, ...], Timing] = {}
            for op in ops:
                if op in PAGE_OPS and rows < BLOCK_SIZE:
                    continue
                ratios = s.miss_ratios if op in ROW_OPS else (None,)
                for i, ratio in enumerate(ratios):
                    out += self.case(op, {**params, "miss_ratio": ratio}, pools, baseline,
                                     with_baselines=i == 0)
                    if on_case is not None:
                        on_case()

    def case(self, op: str, params: dict[str, Any], pools: Pools,
             baseline: dict[tuple[Any, ...], Timing], *, with_baselines: bool) -> list[Figure]:
        """Figures of one op at one size and miss ratio. Baselines do not depend on the miss
        ratio: measured once per op and size (``with_baselines``) and kept in ``baseline``
        (the contiguous copy is shared by the ops of one direction)."""
        s = self.s
        rows, ratio = params["rows"], params["miss_ratio"]
        direction = DIRECTION[op]
        seed = s.seed + rows
        if op in PAGE_OPS:
            pages = rows // BLOCK_SIZE
            blocks = pools.num_rows // BLOCK_SIZE
            v = plan_variants(blocks, pages, pages * 8, s.max_plan_bytes)
            plans = make_page_plans(pages, blocks, blocks, self.device, variants=v, seed=seed)
            params = {**params, "rows": pages * BLOCK_SIZE, "pages": pages}
            span = BLOCK_SIZE * pools.row_bytes
        else:
            num, width, _ = plan_geometry(rows, s.top_k, ratio)
            v = plan_variants(pools.num_rows, rows, num * width * 8 + rows * 16,
                              s.max_plan_bytes)
            plans = make_row_plans(rows, s.top_k, ratio, pools.num_rows, pools.num_rows,
                                   self.device, variants=v, seed=seed)
            span = pools.row_bytes
        nbytes = params["rows"] * pools.layers * pools.row_bytes
        params = {**params, "bytes": nbytes, "plan": list(plans.shape), "rotation": v}
        keys = {"contiguous": ("contiguous", direction, nbytes), "eager": ("eager", op)}
        figures: list[Figure] = []
        for method in self.methods:
            if method in BASELINES and not with_baselines:
                continue
            fig_params = {**params, "miss_ratio": None} if method in BASELINES else params
            note = f"{op} {pools.row_bytes}B x{rows} L{pools.layers} {method}"
            key = keys.get(method)
            if key is not None and key in baseline:
                figures.append(Figure(op, method, fig_params, baseline[key],
                                      gbps=gbps(nbytes, baseline[key].median_ms)))
                self.step(note)
                continue
            figures += self._measure(op, method, fig_params, plans, pools, span, key, baseline)
            self.step(note)
        for fig in figures:
            if fig.gbps is None:
                continue
            eager, contig = baseline.get(keys["eager"]), baseline.get(keys["contiguous"])
            if eager is not None:
                fig.vs_eager = fig.gbps / gbps(nbytes, eager.median_ms)
            if contig is not None:
                fig.vs_contiguous = fig.gbps / gbps(nbytes, contig.median_ms)
        return figures

    def _measure(self, op: str, method: str, params: dict[str, Any], plans: RowPlans,
                 pools: Pools, span: int, key: Optional[tuple[Any, ...]],
                 baseline: dict[tuple[Any, ...], Timing]) -> list[Figure]:
        """The figure(s) of one method (``triton`` on CUDA adds ``triton_graph``); a failing
        method gives a figure with its error, never an exception."""
        nbytes = params["bytes"]
        extra: dict[str, Any] = {}
        try:
            if method == "contiguous":
                timing, ok = self._contiguous(DIRECTION[op], nbytes, pools), None
            elif method == "eager":
                timing, ok = self._eager(op, plans, pools)
            else:
                if method == "triton":
                    extra["launch_config"] = launch_config_source(op, span, pools.layers)
                timing, ok = self._kernel(op, method, plans, pools)
        except Exception as exc:  # noqa: BLE001 - one failing method must not end the run
            return [Figure(op, method, params, error=f"{type(exc).__name__}: {exc}")]
        if key is not None:
            baseline[key] = timing
        figures = [Figure(op, method, params, timing, gbps=gbps(nbytes, timing.median_ms),
                          verified=ok, error=None if ok is not False else WRONG_BYTES,
                          extra=extra)]
        if method == "triton" and self.cuda and self.s.graph:
            try:
                timing, ok = self._graph(op, plans, pools)
                figures.append(Figure(op, GRAPH_METHOD, params, timing,
                                      gbps=gbps(nbytes, timing.median_ms), verified=ok,
                                      error=None if ok is not False else WRONG_BYTES,
                                      extra=extra))
            except Exception as exc:  # noqa: BLE001
                figures.append(Figure(op, GRAPH_METHOD, params,
                                      error=f"{type(exc).__name__}: {exc}"))
        return figures

    # ---- methods

    def _contiguous(self, direction: str, nbytes: int, pools: Pools) -> Timing:
        run, windows = contiguous_runner(direction, nbytes, pools)
        return self._time(Rotation(windows, run), host_part=False)

    def _eager(self, op: str, plans: RowPlans, pools: Pools) -> tuple[Timing, Optional[bool]]:
        run = eager_runner(op, plans, pools, self.device)
        ok = self._verify(op, plans, pools, lambda: run(0))
        return self._time(Rotation(plans.variants, run), host_part=True), ok

    def _kernel(self, op: str, method: str, plans: RowPlans, pools: Pools
                ) -> tuple[Timing, Optional[bool]]:
        run = kernel_runner(op, method, plans, pools)
        ok = self._verify(op, plans, pools, lambda: run(0))
        return self._time(Rotation(plans.variants, run), host_part=method != "triton"), ok

    def _graph(self, op: str, plans: RowPlans, pools: Pools) -> tuple[Timing, Optional[bool]]:
        """The rotation's ``V`` Triton calls captured in one CUDA graph; per-call time."""
        run = kernel_runner(op, "triton", plans, pools)
        graph, _ = capture_graph(lambda: [run(i) for i in range(plans.variants)],
                                 warmup_calls=1)
        ok = self._verify(op, plans, pools, graph.replay)
        t = self.watched(lambda: device_time(graph.replay, warmup_ms=self.s.warmup_ms,
                                             rep_ms=self.s.rep_ms))
        v = plans.variants
        return Timing(t.median_ms / v, t.p20_ms / v, t.p80_ms / v, t.reps, t.probe_us), ok

    # ---- verification

    def _verify(self, op: str, plans: RowPlans, pools: Pools, run: Callable[[], Any]
                ) -> Optional[bool]:
        """``verify_transfer`` of plan 0; ``None`` when ``settings.verify`` is off."""
        if not self.s.verify:
            return None
        return verify_transfer(op, plans, pools, self.device, run, seed=self.s.seed)


# --------------------------------------------------------------------------- the methods


def tables(op: str, pools: Pools) -> tuple[RowTable, RowTable]:
    """``(dst, src)`` tables of ``op``."""
    if DIRECTION[op] == "h2d":
        return pools.device, pools.host
    return pools.host, pools.device


def transfer_indices(op: str, plans: RowPlans, pools: Pools, device: torch.device,
                     variants: slice = slice(None)
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(host_idx, device_idx, host_view, device_view)``: ``[V, L * n] int64`` flat indices
    of the units (rows, or pages) ``plans`` moves in ``variants``, into the 2-D views
    ``host_view`` / ``device_view`` (``host_idx`` on the CPU, ``device_idx`` on ``device``),
    in the same order on both sides."""
    L = pools.layers
    h2d = DIRECTION[op] == "h2d"
    h_valid = (plans.src_valid if h2d else plans.dst_valid)[variants]
    d_valid = (plans.dst_valid if h2d else plans.src_valid)[variants]
    if op in PAGE_OPS:
        page = BLOCK_SIZE * pools.row_bytes
        host_view = pools.host.pool.view(-1, page)
        dev_view = pools.device.pool.view(-1, page)
        blocks = pools.num_rows // BLOCK_SIZE
        layer = torch.arange(L, dtype=torch.int64)[None, :, None]
        host_idx = (layer * blocks + h_valid[:, None, :]).reshape(h_valid.shape[0], -1)
        dev_idx = (d_valid[:, None, :] * L + layer).reshape(d_valid.shape[0], -1)
    else:
        host_view, dev_view = pools.host_flat, pools.device_flat
        host_idx = host_flat_rows(h_valid, L, pools.num_rows)
        dev_idx = device_flat_rows(d_valid, L)
    return host_idx, dev_idx.to(device), host_view, dev_view


def contiguous_runner(direction: str, nbytes: int, pools: Pools
                      ) -> tuple[Callable[[int], None], int]:
    """``(run, windows)``: ``run(i)`` copies window ``i`` of ``nbytes`` between the host pool
    (contiguous, pinned on CUDA) and the device pool in ``direction``; ``windows`` fit."""
    host, dev = pools.host.pool, pools.device.pool

    def run(i: int) -> None:
        lo = i * nbytes
        if direction == "h2d":
            dev[lo:lo + nbytes].copy_(host[lo:lo + nbytes], non_blocking=True)
        else:
            host[lo:lo + nbytes].copy_(dev[lo:lo + nbytes], non_blocking=True)

    return run, max(1, host.numel() // nbytes)


def eager_runner(op: str, plans: RowPlans, pools: Pools, device: torch.device
                 ) -> Callable[[int], None]:
    """``run(i)`` moves plan ``i`` the torch-eager way: ``index_select`` into a staging buffer
    (pinned on CUDA), one ``copy_`` across the link, ``index_copy_`` into the destination."""
    host_idx, dev_idx, host_view, dev_view = transfer_indices(op, plans, pools, device)
    n, width = host_idx.shape[1], host_view.shape[1]
    staging_host = alloc_host(n * width, device).view(n, width)
    staging_dev = torch.empty(n, width, dtype=torch.uint8, device=device)

    if DIRECTION[op] == "h2d":
        def run(i: int) -> None:
            torch.index_select(host_view, 0, host_idx[i], out=staging_host)
            staging_dev.copy_(staging_host, non_blocking=True)
            dev_view.index_copy_(0, dev_idx[i], staging_dev)
    else:
        def run(i: int) -> None:
            torch.index_select(dev_view, 0, dev_idx[i], out=staging_dev)
            staging_host.copy_(staging_dev)  # synchronous: the host needs the bytes
            host_view.index_copy_(0, host_idx[i], staging_host)

    return run


def kernel_runner(op: str, method: str, plans: RowPlans, pools: Pools
                  ) -> Callable[[int], None]:
    """``run(i)``: ``ops.copy_rows`` / ``copy_pages`` of plan ``i`` with backend ``method``."""
    ops = _ops()
    fn = ops.copy_pages if op in PAGE_OPS else ops.copy_rows
    dst, src = tables(op, pools)
    counts = plans.counts

    def run(i: int) -> None:
        fn(dst, src, plans.src[i], plans.dst[i], None if counts is None else counts[i],
           backend=method)

    return run


def verify_transfer(op: str, plans: RowPlans, pools: Pools, device: torch.device,
                    run: Callable[[], Any], *, seed: int = 0) -> bool:
    """Does ``run()`` move plan 0 of ``plans``? Its destination units (all of them, or
    ``VERIFY_BYTES`` of them picked at random across the layers) are first overwritten with
    the complement of the source bytes; after ``run()`` they must equal the source units."""
    host_idx, dev_idx, host_view, dev_view = transfer_indices(op, plans, pools, device,
                                                              slice(0, 1))
    host_idx, dev_idx = host_idx[0], dev_idx[0]
    most = max(1, VERIFY_BYTES // host_view.shape[1])
    if host_idx.numel() > most:
        pick = torch.randperm(host_idx.numel(), generator=torch.Generator().manual_seed(seed))
        pick = pick[:most]
        host_idx, dev_idx = host_idx[pick], dev_idx[pick.to(dev_idx.device)]
    if DIRECTION[op] == "h2d":
        expected = host_view.index_select(0, host_idx).to(device)
        dev_view.index_copy_(0, dev_idx, torch.bitwise_not(expected))
    else:
        expected = dev_view.index_select(0, dev_idx).cpu()
        host_view.index_copy_(0, host_idx, torch.bitwise_not(expected))
    sync(device)
    run()
    sync(device)
    host_rows = host_view.index_select(0, host_idx)
    dev_rows = dev_view.index_select(0, dev_idx).cpu()
    return bool(torch.equal(host_rows, dev_rows))
