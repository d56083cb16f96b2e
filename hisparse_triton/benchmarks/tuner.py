"""The launch-config search behind ``hisparse-triton tune``: the candidates of a transfer
kernel, their check against the torch reference, their timing on the current GPU, and the
tuning-cache entries of the winners (``hisparse_triton.tuning_cache``).

For each kernel (a tunable op of ``registry``: ``gather``, ``backup``, ``restore``,
``spill``) and layer count, at one row size, the candidates are built from the fields of
``hisparse_triton.tuning.CopyConfig`` (a field this module has no value list for keeps its
default):

- stage 1: every combination of ``rows_per_program`` x ``chunk_bytes`` x ``num_warps``
  around the built-in default (the other fields at their defaults);
- stage 2: around the stage-1 winner, one field at a time: ``grid_programs``,
  ``layers_per_program``, ``access_bytes``, ``num_stages``; then the winners combined.

Candidates are normalised to what the launcher would actually run (``chunk_bytes`` above the
span, ``access_bytes`` above the rows' alignment and ``layers_per_program`` above the layer
count change nothing) and deduplicated. Every candidate is first checked against
``reference.copy_rows`` / ``copy_pages`` on a plan with partial counts and out-of-range ids;
a candidate that fails to compile, launch or match is rejected, never timed. The rest are
timed with ``triton.testing.do_bench`` on rotated plans (``benchmarks.timing``).

``candidate_space`` and ``stage2_candidates`` need neither torch nor a GPU (``tune
--dry-run``); ``Tuner`` needs CUDA (or ``TRITON_INTERPRET=1`` on a CPU device);
``tune_space`` runs both stages with any object that has ``Tuner``'s ``trial``.
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Optional, Protocol

from hisparse_triton.benchmarks.registry import PAGE_OPS, get_op, launcher

#: Rows per page of the page kernels.
BLOCK_SIZE = 64
#: Stage 1 fields (full grid) and stage 2 fields (one at a time around the stage-1 winner).
STAGE1 = ("rows_per_program", "chunk_bytes", "num_warps")
STAGE2 = ("grid_programs", "layers_per_program", "access_bytes", "num_stages")
#: A candidate replaces the built-in default only when at least this much faster.
MIN_GAIN = 0.01
#: Largest tile one program moves per step (rows_per_program x chunk_bytes).
MAX_TILE_BYTES = 32 << 10


def _pow2_range(lo: int, hi: int) -> list[int]:
    out, v = [], 1
    while v <= hi:
        if v >= lo:
            out.append(v)
        v *= 2
    return out


def span_bytes(kernel: str, row_bytes: int) -> int:
    """Bytes one plan entry moves: a row, or a whole page for ``restore`` / ``spill``; this is
    the ``row_bytes`` argument of ``tuning.default_config`` and of the cache key."""
    return row_bytes * BLOCK_SIZE if kernel in PAGE_OPS else row_bytes


def builtin_config(kernel: str, span: int, num_layers: int) -> Any:
    """The built-in default (not a tuned entry) of ``kernel``."""
    from hisparse_triton import tuning

    fn = getattr(tuning, "builtin_config", None) or tuning.default_config
    return fn(kernel, span, num_layers)


@dataclass
class Space:
    """The candidates of one (kernel, span, layers): normalised, deduplicated."""

    kernel: str
    span: int
    num_layers: int
    default: Any
    values: dict[str, list[Any]]
    stage1: list[Any]
    fixed: list[str] = field(default_factory=list)


def normalise(config: Any, span: int, num_layers: int) -> Any:
    """``config`` with the fields the launcher would clamp clamped (same kernel behaviour)."""
    from hisparse_triton.tuning import next_pow2, pow2_alignment

    changes: dict[str, Any] = {}
    names = {f.name for f in fields(config)}
    align = pow2_alignment(span)
    if "access_bytes" in names:
        changes["access_bytes"] = min(config.access_bytes, align)
    if "chunk_bytes" in names:
        access = changes.get("access_bytes", 16)
        changes["chunk_bytes"] = max(access, min(config.chunk_bytes, next_pow2(span)))
    if "layers_per_program" in names:
        changes["layers_per_program"] = min(config.layers_per_program, next_pow2(num_layers))
    return replace(config, **changes)


def field_values(name: str, default: Any, kernel: str, span: int, num_layers: int, *,
                 quick: bool, sm_count: Optional[int]) -> Optional[list[Any]]:
    """Candidate values of one ``CopyConfig`` field (``None``: keep the default)."""
    from hisparse_triton.tuning import next_pow2, pow2_alignment

    if name == "rows_per_program":
        lo, hi = (default // 2, default * 2) if quick else (default // 4, default * 4)
        return _pow2_range(max(1, lo), hi)
    if name == "chunk_bytes":
        lo, hi = (default // 2, default) if quick else (default // 4, default * 2)
        return _pow2_range(max(16, lo), min(hi, max(16, next_pow2(span))))
    if name == "num_warps":
        return [4, 8] if quick else [2, 4, 8]
    if name == "grid_programs":
        if sm_count:
            return [sm_count * k for k in ((8, 32) if quick else (4, 8, 16, 32, 64))]
        return [1024, 16384] if quick else [1024, 2048, 8192, 16384]
    if name == "layers_per_program":
        return _pow2_range(1, min(8, next_pow2(num_layers)))
    if name == "access_bytes":
        return _pow2_range(4, min(16, pow2_alignment(span)))
    if name == "num_stages":
        return [1, 2]
    return None


def candidate_space(kernel: str, row_bytes: int, num_layers: int, *, quick: bool = False,
                    sm_count: Optional[int] = None) -> Space:
    """Stage-1 candidates and stage-2 values of ``kernel`` (see the module docstring)."""
    from hisparse_triton.tuning import CopyConfig

    span = span_bytes(kernel, row_bytes)
    default = normalise(builtin_config(kernel, span, num_layers), span, num_layers)
    values: dict[str, list[Any]] = {}
    fixed: list[str] = []
    for f in fields(CopyConfig):
        base = getattr(default, f.name)
        vals = field_values(f.name, base, kernel, span, num_layers, quick=quick,
                            sm_count=sm_count)
        if vals is None:
            fixed.append(f.name)
            continue
        values[f.name] = sorted(set(vals) | {base})
    grid_names = [n for n in STAGE1 if n in values]
    stage1: list[Any] = []
    seen = set()
    for combo in itertools.product(*(values[n] for n in grid_names)):
        try:
            cand = normalise(replace(default, **dict(zip(grid_names, combo))), span, num_layers)
        except ValueError:
            continue  # not a valid CopyConfig (e.g. chunk smaller than the access)
        tile = getattr(cand, "rows_per_program", 1) * getattr(cand, "chunk_bytes", 1)
        if cand != default and tile > MAX_TILE_BYTES:
            continue
        if cand not in seen:
            seen.add(cand)
            stage1.append(cand)
    if default not in seen:
        stage1.insert(0, default)
    return Space(kernel, span, num_layers, default, values, stage1, fixed)


def stage2_candidates(space: Space, best: Any) -> list[Any]:
    """One-field variations of ``best`` over the stage-2 fields."""
    out, seen = [], {best}
    for name in STAGE2:
        for value in space.values.get(name, []):
            try:
                cand = normalise(replace(best, **{name: value}), space.span, space.num_layers)
            except ValueError:
                continue
            if cand not in seen:
                seen.add(cand)
                out.append(cand)
    return out


def config_text(config: Any, default: Any = None) -> str:
    parts = []
    for f in fields(config):
        value = getattr(config, f.name)
        mark = "*" if default is not None and value != getattr(default, f.name) else ""
        parts.append(f"{f.name}={value}{mark}")
    return " ".join(parts)


# ----------------------------------------------------------------- measuring (CUDA)

@dataclass
class Trial:
    config: Any
    stage: int
    time_us: Optional[float] = None
    gbps: Optional[float] = None
    rejected: Optional[str] = None

    def to_json(self) -> dict[str, Any]:
        out = {"config": asdict(self.config), "stage": self.stage}
        if self.rejected is not None:
            out["rejected"] = self.rejected
        else:
            out["time_us"] = round(self.time_us, 3) if self.time_us is not None else None
            out["gbps"] = round(self.gbps, 3) if self.gbps is not None else None
        return out


class Tuner:
    """Checks and times candidates of one (kernel, row size, layers) on the current GPU."""

    def __init__(self, kernel: str, row_bytes: int, num_layers: int, *, rows: int, top_k: int,
                 warmup_ms: float, rep_ms: float, seed: int = 0,
                 device: Optional[Any] = None, pool_rows: Optional[int] = None) -> None:
        """Pools of ``pool_rows`` rows per layer (default: enough for the rotation to span
        twice the L2 size and for the verification plan) on ``device`` (default: the current
        CUDA device; a CPU device runs the kernels only under ``TRITON_INTERPRET=1``)."""
        import torch

        from hisparse_triton import benchmarks as bm

        self.kernel = kernel
        self.device = device if device is not None else \
            torch.device("cuda", torch.cuda.current_device())
        self.warmup_ms, self.rep_ms = warmup_ms, rep_ms
        self.launch = launcher(kernel)
        if pool_rows is None:
            l2 = torch.cuda.get_device_properties(self.device).L2_cache_size \
                if self.device.type == "cuda" else 0
            pool_rows = max(rows, 32 * top_k, -(-2 * l2 // (row_bytes * num_layers)))
        self.pools = bm.make_pools(row_bytes, num_layers, pool_rows, self.device, seed=seed)
        pages = kernel in PAGE_OPS
        h2d = get_op(kernel).direction == "h2d"
        self.dst, self.src = (self.pools.device, self.pools.host) if h2d else \
            (self.pools.host, self.pools.device)
        if pages:
            units = max(1, rows // BLOCK_SIZE)
            blocks = self.pools.num_rows // BLOCK_SIZE
            variants = max(1, min(64, blocks // units))
            self.plans = bm.make_page_plans(units, blocks, blocks, self.device,
                                            variants=variants, seed=seed)
            self.bytes = units * BLOCK_SIZE * row_bytes * num_layers
            self.units = units
        else:
            variants = max(1, min(64, self.pools.num_rows // rows))
            self.plans = bm.make_row_plans(rows, top_k, 1.0, self.pools.num_rows,
                                           self.pools.num_rows, self.device,
                                           variants=variants, seed=seed)
            self.bytes = rows * row_bytes * num_layers
            self.units = rows
        self._make_check(pages, top_k, seed)

    def _make_check(self, pages: bool, top_k: int, seed: int) -> None:
        """A verification plan (partial counts, -1, out-of-range and huge ids, enough work
        items to exercise the grid-stride loop) and the reference result."""
        import torch

        from hisparse_triton.ops.copy import reference
        from hisparse_triton.row_table import RowTable

        gen = torch.Generator().manual_seed(seed + 1)
        n_src = self.src.num_blocks if pages else self.src.num_rows
        n_dst = self.dst.num_blocks if pages else self.dst.num_rows
        width = min(top_k, max(1, n_dst // 8)) if not pages else min(64, max(1, n_dst // 8))
        rows = max(1, min(32, n_dst // width))
        src = torch.randint(0, n_src, (rows, width), generator=gen, dtype=torch.int64)
        dst = torch.randperm(n_dst, generator=gen)[:rows * width].view(rows, width)
        bad = torch.rand(rows, width, generator=gen) < 0.05
        src[bad] = torch.tensor([-1, n_src, 2**31 - 1])[torch.randint(0, 3, (int(bad.sum()),),
                                                                      generator=gen)]
        bad_dst = torch.rand(rows, width, generator=gen) < 0.02
        dst[bad_dst] = n_dst
        counts = torch.randint(0, width + 1, (rows,), generator=gen, dtype=torch.int32)
        counts[0] = width
        self.check_plan = tuple(t.to(torch.int32).to(self.device) for t in (src, dst, counts))

        def cpu_table(t: RowTable) -> RowTable:
            return RowTable(pool=t.pool.detach().cpu().clone(),
                            layer_offsets=t.layer_offsets.cpu(), row_bytes=t.row_bytes,
                            block_size=t.block_size, block_stride=t.block_stride,
                            num_rows=t.num_rows)

        ref_dst, ref_src = cpu_table(self.dst), cpu_table(self.src)
        fn = reference.copy_pages if pages else reference.copy_rows
        fn(ref_dst, ref_src, src.to(torch.int32), dst.to(torch.int32), counts)
        self.dst_before = self.dst.pool.clone()
        self.expected = ref_dst.pool.to(self.dst.pool.device)

    def check(self, config: Any) -> Optional[str]:
        """``None`` when ``config`` matches the reference, else why it does not."""
        import torch

        self.dst.pool.copy_(self.dst_before)
        src, dst, counts = self.check_plan
        try:
            self.launch(self.dst, self.src, src, dst, counts, config=config)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
        except Exception as exc:  # noqa: BLE001 - compile / launch failures reject a candidate
            return f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
        if not torch.equal(self.dst.pool, self.expected):
            return "result differs from the reference"
        return None

    def time(self, config: Any) -> float:
        """Median ms of one launch (rotating plans)."""
        from hisparse_triton import benchmarks as bm

        plans = self.plans

        def run(i: int) -> None:
            self.launch(self.dst, self.src, plans.src[i], plans.dst[i],
                        None if plans.counts is None else plans.counts[i], config=config)

        return bm.device_time(bm.Rotation(plans.variants, run), warmup_ms=self.warmup_ms,
                              rep_ms=self.rep_ms).median_ms

    def trial(self, config: Any, stage: int) -> Trial:
        from hisparse_triton import benchmarks as bm

        why = self.check(config)
        if why is not None:
            return Trial(config, stage, rejected=why)
        try:
            ms = self.time(config)
        except Exception as exc:  # noqa: BLE001
            return Trial(config, stage, rejected=f"{type(exc).__name__}: {exc}")
        return Trial(config, stage, time_us=ms * 1e3, gbps=bm.gbps(self.bytes, ms))


class TrialRunner(Protocol):
    """What ``tune_space`` needs of a ``Tuner``: one checked and timed candidate, and the
    size of what a timed launch moves (``units`` rows or pages, ``bytes``, ``plans.shape``)."""

    units: int
    bytes: int
    plans: Any

    def trial(self, config: Any, stage: int) -> Trial: ...


def tune_space(space: Space, tuner: TrialRunner, *, row_bytes: int,
               progress_enabled: bool = False) -> dict[str, Any]:
    """Run both stages of ``space`` with ``tuner``; the JSON record (best, default, every
    trial). The default is kept unless a candidate is at least ``MIN_GAIN`` faster."""
    from hisparse_triton.benchmarks.progress import Progress

    label = f"tune {space.kernel} {row_bytes}B L{space.num_layers}"
    stage2_max = sum(len(v) for n, v in space.values.items() if n in STAGE2) + 1
    progress = Progress(len(space.stage1) + stage2_max, label, enabled=progress_enabled)
    trials: list[Trial] = []
    for cand in space.stage1:
        trials.append(tuner.trial(cand, 1))
        progress.step(config_text(cand))
    ok1 = [t for t in trials if t.time_us is not None]
    if not ok1:
        raise ValueError(f"every stage-1 candidate of {space.kernel} was rejected; first: "
                         f"{trials[0].rejected}")
    best1 = min(ok1, key=lambda t: t.time_us).config
    winners: dict[str, Any] = {}
    for cand in stage2_candidates(space, best1):
        trial = tuner.trial(cand, 2)
        trials.append(trial)
        progress.step(config_text(cand))
    # Combine the stage-2 winners of each field (when they beat the stage-1 best).
    base_time = min(t.time_us for t in ok1)
    for name in STAGE2:
        mine = [t for t in trials if t.stage == 2 and t.time_us is not None
                and getattr(t.config, name) != getattr(best1, name)
                and all(getattr(t.config, f.name) == getattr(best1, f.name)
                        for f in fields(best1) if f.name != name)]
        if mine:
            top = min(mine, key=lambda t: t.time_us)
            if top.time_us < base_time:
                winners[name] = getattr(top.config, name)
    if len(winners) > 1:
        combo = normalise(replace(best1, **winners), space.span, space.num_layers)
        if all(t.config != combo for t in trials):
            trials.append(tuner.trial(combo, 3))
    progress.done = progress.total - 1
    progress.step("done")
    timed = [t for t in trials if t.time_us is not None]
    best = min(timed, key=lambda t: t.time_us)
    default = next((t for t in trials if t.config == space.default), None)
    if default is not None and default.time_us is not None \
            and best.time_us > default.time_us * (1 - MIN_GAIN):
        best = default  # within noise of the default: keep the default
    record = {
        "kernel": space.kernel, "row_bytes": row_bytes, "span_bytes": space.span,
        "num_layers": space.num_layers, "rows": tuner.units, "bytes": tuner.bytes,
        "plan": list(tuner.plans.shape),
        "best": best.to_json(),
        "default": default.to_json() if default is not None else None,
        "speedup_vs_default": (round(default.time_us / best.time_us, 3)
                               if default is not None and default.time_us else None),
        "candidates": len(trials),
        "rejected": sum(1 for t in trials if t.rejected is not None),
        "trials": [t.to_json() for t in trials],
    }
    return record


def save_records(records: list[dict[str, Any]], path: Any, device_name: str,
                 env: dict[str, Any]) -> None:
    """Put the best config of every ``tune_space`` record into the cache at ``path`` (other
    entries kept) and make ``tuning.default_config`` read it again."""
    from hisparse_triton import tuning, tuning_cache

    cache = tuning_cache.TuningCache.load(path, device_name=device_name)
    for record in records:
        best = record["best"]
        cache.put(tuning_cache.TuningEntry(
            record["kernel"], record["span_bytes"], record["num_layers"],
            config=dict(best["config"]),
            metrics={"time_us": best["time_us"], "gbps": best["gbps"],
                     "default_time_us": (record["default"] or {}).get("time_us"),
                     "speedup_vs_default": record["speedup_vs_default"],
                     "row_size": record["row_bytes"], "rows": record["rows"],
                     "torch": env.get("torch"), "triton": env.get("triton"),
                     "driver": env.get("driver"), "tuned_at": tuning_cache.now_iso()}))
    cache.save()
    clear = getattr(tuning.default_config, "cache_clear", None)
    if clear is not None:
        clear()


def best_config(trial_json: dict[str, Any]) -> Any:
    """The ``CopyConfig`` of a trial's JSON record."""
    from hisparse_triton.tuning import CopyConfig

    return CopyConfig(**trial_json["config"])


__all__ = ["BLOCK_SIZE", "MAX_TILE_BYTES", "MIN_GAIN", "STAGE1", "STAGE2", "Space", "Trial",
           "TrialRunner", "Tuner", "best_config", "builtin_config", "candidate_space",
           "config_text", "field_values", "normalise", "save_records", "span_bytes",
           "stage2_candidates", "tune_space"]
