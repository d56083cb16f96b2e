"""The measurement library behind ``hisparse-triton bench`` (and ``tune``, ``bench/gpu_check.py``).

What is measured (DESIGN.md section 9), for every row size x rows moved x layers per launch:

- ``gather`` (host -> device rows), ``backup`` (device -> host rows), ``restore`` (whole
  pages host -> device) and ``spill`` (whole pages device -> host) in GB/s, for the methods
  - ``triton``: the kernels through ``hisparse_triton.ops`` (CUDA only),
  - ``torch``: the torch backend of the same ops (``reference.py``),
  - ``eager`` (baseline): what one writes without this package: ``index_select`` of the rows
    on the source pool into a staging buffer, one ``copy_`` across the link, ``index_copy_``
    into the destination pool (indices precomputed on both sides, which favours eager),
  - ``contiguous`` (baseline, the link ceiling): one ``copy_`` of the same number of bytes
    between a contiguous pinned host buffer and device memory;
  every figure carries its ratio to both baselines (``vs_eager``, ``vs_contiguous``).
- ``resolve`` latency for batch x top-k x hot-buffer size, ``triton`` and ``torch``.

Workloads mirror decode: a row plan is ``[R, top_k] int32`` with ``miss_ratio * top_k`` valid
columns per row (``counts``), ``-1`` beyond, random distinct rows on both sides; the device
pool lays the layers one page apart inside each block (as the planner does), the host pool is
layer-major. Bytes counted are payload only: ``rows x layers x row_bytes``.

Timing: on CUDA, device-only work is timed with ``triton.testing.do_bench`` (median; it
also clears L2 between calls) and work with a host part (``torch``, ``eager``) with a wall
clock around a synchronised call; each call moves a different plan out of a rotation whose
buffers span more than twice the L2 size. On CPU only the torch paths run, with a wall clock:
kernel timings need a GPU, and the result says so (``kernel_timings: false``).
"""

from __future__ import annotations

import math
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Iterable, Optional, Sequence, TextIO

import torch

from hisparse_triton.row_table import RowTable

#: ``schema`` / ``version`` of the JSON ``bench`` writes.
SCHEMA = "hisparse-triton/bench"
VERSION = 1

TRANSFER_OPS = ("gather", "backup", "restore", "spill")
PAGE_OPS = ("restore", "spill")
ALL_OPS = TRANSFER_OPS + ("resolve",)
KERNEL_METHODS = ("triton", "torch")
BASELINES = ("eager", "contiguous")
#: Direction of each transfer op: ``"h2d"`` or ``"d2h"``.
DIRECTION = {"gather": "h2d", "backup": "d2h", "restore": "h2d", "spill": "d2h"}

BLOCK_SIZE = 64
#: Miss ratios of DESIGN.md section 9 (GLM-5.1 trace, LRU): cold, buffer = k, buffer = 4k.
DEFAULT_MISS_RATIOS = (1.0, 0.3, 0.067)

KERNELS_NEED_GPU = ("kernel timings need a GPU: no CUDA device here, so only the torch "
                    "paths (reference, eager, contiguous copy) were timed")


@dataclass(frozen=True)
class BenchSettings:
    """One benchmark sweep. ``for_device`` gives the defaults of a device.

    - ``row_bytes``, ``rows``, ``layers``, ``miss_ratios``: the transfer sweep (rows moved per
      launch per layer; pages cases move ``rows // 64`` pages and ignore ``miss_ratios``).
    - ``top_k``: plan width (columns per batch row) of the transfer plans and of resolve.
    - ``batch``, ``hot_slots``, ``seq_len``: the resolve sweep.
    - ``ops``, ``methods``: what to run (``methods`` from ``KERNEL_METHODS + BASELINES``).
    - ``warmup_ms``, ``rep_ms``: timing budget per figure.
    - ``rotate_bytes``: the rotation of plans/buffers spans at least this many bytes.
    - ``max_plan_bytes``: cap on the memory spent on rotated plans per case.
    - ``verify``: check the rows the kernel methods moved against the source rows.
    """

    row_bytes: tuple[int, ...]
    rows: tuple[int, ...]
    layers: tuple[int, ...]
    miss_ratios: tuple[float, ...]
    top_k: int
    batch: tuple[int, ...]
    hot_slots: int
    seq_len: int
    ops: tuple[str, ...] = ALL_OPS
    methods: tuple[str, ...] = KERNEL_METHODS + BASELINES
    warmup_ms: float = 10.0
    rep_ms: float = 50.0
    rotate_bytes: int = 256 << 20
    max_plan_bytes: int = 64 << 20
    verify: bool = True
    seed: int = 0

    @classmethod
    def for_device(cls, device: torch.device, *, quick: bool = False) -> "BenchSettings":
        """Defaults: the full sweep on CUDA, a tiny one on CPU; ``quick`` shrinks either."""
        if device.type == "cuda":
            l2 = torch.cuda.get_device_properties(device).L2_cache_size
            rotate = max(2 * l2, 64 << 20)
            if quick:
                return cls(row_bytes=(656,), rows=(4096, 65536), layers=(1, 4),
                           miss_ratios=(1.0,), top_k=2048, batch=(64,), hot_slots=4096,
                           seq_len=32768, rotate_bytes=rotate, warmup_ms=5, rep_ms=25)
            return cls(row_bytes=(132, 656, 1152),
                       rows=(512, 2048, 8192, 32768, 131072, 262144), layers=(1, 4),
                       miss_ratios=DEFAULT_MISS_RATIOS, top_k=2048, batch=(1, 4, 16, 64, 256),
                       hot_slots=4096, seq_len=32768, rotate_bytes=rotate)
        if quick:
            return cls(row_bytes=(656,), rows=(512,), layers=(1,), miss_ratios=(1.0,),
                       top_k=256, batch=(1,), hot_slots=512, seq_len=4096,
                       rotate_bytes=4 << 20, warmup_ms=1, rep_ms=5)
        return cls(row_bytes=(132, 656, 1152), rows=(512, 4096), layers=(1,),
                   miss_ratios=(1.0,), top_k=2048, batch=(1, 4), hot_slots=4096,
                   seq_len=32768, rotate_bytes=16 << 20, warmup_ms=2, rep_ms=10)

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first bad setting."""
        for name in ("row_bytes", "rows", "layers", "batch"):
            values = getattr(self, name)
            if not values or any(not isinstance(v, int) or v <= 0 for v in values):
                raise ValueError(f"--{name.replace('_', '-')} needs positive integers, "
                                 f"got {values!r}.")
        if not self.miss_ratios or any(not 0 < m <= 1 for m in self.miss_ratios):
            raise ValueError(f"miss ratios must lie in (0, 1], got {self.miss_ratios!r}.")
        for name in ("top_k", "hot_slots", "seq_len"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, "
                                 f"got {getattr(self, name)}.")
        if self.hot_slots < self.top_k:
            raise ValueError(f"--hot-slots={self.hot_slots} must be >= --top-k={self.top_k} "
                             f"(one step's top-k must fit the hot buffer).")
        if self.seq_len < self.top_k:
            raise ValueError(f"--seq-len={self.seq_len} must be >= --top-k={self.top_k}.")
        bad = [op for op in self.ops if op not in ALL_OPS]
        if bad or not self.ops:
            raise ValueError(f"unknown op(s) {bad!r}; choose from {', '.join(ALL_OPS)}.")
        bad = [m for m in self.methods if m not in KERNEL_METHODS + BASELINES]
        if bad or not self.methods:
            raise ValueError(f"unknown method(s) {bad!r}; choose from "
                             f"{', '.join(KERNEL_METHODS + BASELINES)}.")


# --------------------------------------------------------------------------- environment

def _git_commit() -> Optional[str]:
    try:
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        out = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=5)
        return out.stdout.strip() or None if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def _nvidia_smi() -> dict[str, Any]:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,pcie.link.gen.max,"
                              "pcie.link.width.max", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return {}
    if out.returncode != 0 or not out.stdout.strip():
        return {}
    fields_ = [f.strip() for f in out.stdout.strip().splitlines()[0].split(",")]
    keys = ("name", "driver", "pcie_gen_max", "pcie_width_max")
    return dict(zip(keys, fields_))


def environment() -> dict[str, Any]:
    """Where the numbers come from: GPU name, driver, torch, triton, CUDA, Python, host."""
    import triton

    from hisparse_triton import __version__

    env: dict[str, Any] = {
        "hisparse_triton": __version__,
        "git_commit": _git_commit(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda_available": torch.cuda.is_available(),
        "triton_interpret": os.environ.get("TRITON_INTERPRET") == "1",
        "gpu": None,
        "driver": None,
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        smi = _nvidia_smi()
        env.update({
            "gpu": props.name,
            "gpu_count": torch.cuda.device_count(),
            "compute_capability": f"{props.major}.{props.minor}",
            "sm_count": props.multi_processor_count,
            "gpu_memory_bytes": props.total_memory,
            "l2_cache_bytes": getattr(props, "L2_cache_size", None),
            "cuda_runtime": torch.version.cuda,
            "driver": smi.get("driver"),
            "pcie_gen_max": smi.get("pcie_gen_max"),
            "pcie_width_max": smi.get("pcie_width_max"),
        })
        try:
            env["cuda_driver_api"] = torch._C._cuda_getDriverVersion()
        except Exception:  # noqa: BLE001 - private API, informational only
            pass
    return env


# --------------------------------------------------------------------------- timing

def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class _L2Flush:
    """Zeroes a buffer larger than L2 (CUDA only) to evict it between wall-clock calls."""

    def __init__(self, device: torch.device, nbytes: int) -> None:
        self.buffer = (torch.empty(nbytes // 4, dtype=torch.int32, device=device)
                       if device.type == "cuda" else None)

    def __call__(self) -> None:
        if self.buffer is not None:
            self.buffer.zero_()


def wall_time_ms(fn: Callable[[], Any], device: torch.device, *, warmup_ms: float,
                 rep_ms: float, flush: Optional[Callable[[], None]] = None,
                 max_reps: int = 1000) -> float:
    """Median wall time (ms) of ``fn``, synchronising ``device`` around every call.

    For work with a host part (CPU indexing, synchronous copies): CUDA events would miss the
    CPU time spent before the first kernel. ``flush`` runs (untimed) before every call."""
    flush = flush or (lambda: None)
    flush()
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    estimate = max(time.perf_counter() - start, 1e-7) * 1e3
    for _ in range(min(max_reps, max(0, int(warmup_ms / estimate)))):
        fn()
    reps = int(min(max_reps, max(3, rep_ms / estimate)))
    times = []
    for _ in range(reps):
        flush()
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return float(statistics.median(times))


def device_time_ms(fn: Callable[[], Any], *, warmup_ms: float, rep_ms: float) -> float:
    """Median time (ms) of device-only work: ``triton.testing.do_bench`` (CUDA events, L2
    cleared between calls)."""
    import triton.testing

    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms,
                                         return_mode="median"))


def gbps(nbytes: int, ms: float) -> float:
    """Decimal GB/s of ``nbytes`` moved in ``ms`` milliseconds."""
    return nbytes / (ms * 1e-3) / 1e9 if ms > 0 else float("inf")


# --------------------------------------------------------------------------- progress

class Progress:
    """A minimal progress bar on ``stream`` (stderr): redrawn in place on a terminal, one
    line per 10 % otherwise; silent when ``enabled`` is false."""

    def __init__(self, total: int, label: str, *, stream: Optional[TextIO] = None,
                 enabled: bool = True) -> None:
        self.total = max(total, 1)
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.done = 0
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._last_decile = -1

    def step(self, note: str = "") -> None:
        self.done = min(self.done + 1, self.total)
        if not self.enabled:
            return
        frac = self.done / self.total
        if self._tty:
            width = 30
            bar = "#" * int(frac * width) + "." * (width - int(frac * width))
            self.stream.write(f"\r{self.label} [{bar}] {self.done}/{self.total} {note[:40]:<40}")
            if self.done == self.total:
                self.stream.write("\n")
            self.stream.flush()
        else:
            decile = int(frac * 10)
            if decile != self._last_decile or self.done == self.total:
                self._last_decile = decile
                self.stream.write(f"{self.label}: {self.done}/{self.total} {note}\n")
                self.stream.flush()


# --------------------------------------------------------------------------- transfer setup

@dataclass
class Pools:
    """A host pool and a device pool of ``layers`` layers of ``row_bytes`` rows each.

    Host: layer-major, layer ``l`` row ``g`` is flat row ``l * num_rows + g`` of ``host_flat``.
    Device: blocks outermost, the layers one page apart inside a block, so layer ``l`` row
    ``r`` is flat row ``(r // B) * L * B + l * B + r % B`` of ``device_flat``."""

    host: RowTable
    device: RowTable
    host_flat: torch.Tensor
    device_flat: torch.Tensor
    layers: int
    row_bytes: int
    num_rows: int

    @property
    def nbytes(self) -> int:
        return self.num_rows * self.layers * self.row_bytes


def _alloc_host(nbytes: int, device: torch.device) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=device.type == "cuda")


def make_pools(row_bytes: int, layers: int, num_rows: int, device: torch.device,
               seed: int = 0) -> Pools:
    """Pools of ``num_rows`` rows (a multiple of 64) per layer; the host pool holds random
    bytes, the device pool zeros."""
    num_rows = -(-num_rows // BLOCK_SIZE) * BLOCK_SIZE
    nbytes = num_rows * layers * row_bytes
    host = _alloc_host(nbytes, device)
    gen = torch.Generator(device=device if device.type == "cuda" else "cpu").manual_seed(seed)
    chunk = 256 << 20
    for start in range(0, nbytes, chunk):
        n = min(chunk, nbytes - start)
        host[start:start + n].copy_(torch.randint(0, 256, (n,), dtype=torch.uint8,
                                                  device=gen.device, generator=gen))
    dev = torch.zeros(nbytes, dtype=torch.uint8, device=device)
    page = BLOCK_SIZE * row_bytes
    host_table = RowTable.build(host, [l * num_rows * row_bytes for l in range(layers)],
                                row_bytes=row_bytes, block_size=BLOCK_SIZE, block_stride=page,
                                num_rows=num_rows, device=device)
    dev_table = RowTable.build(dev, [l * page for l in range(layers)], row_bytes=row_bytes,
                               block_size=BLOCK_SIZE, block_stride=layers * page,
                               num_rows=num_rows, device=device)
    return Pools(host=host_table, device=dev_table, host_flat=host.view(-1, row_bytes),
                 device_flat=dev.view(-1, row_bytes), layers=layers, row_bytes=row_bytes,
                 num_rows=num_rows)


def host_flat_rows(rows: torch.Tensor, layers: int, num_rows: int) -> torch.Tensor:
    """``[V, N]`` host row ids -> ``[V, layers * N] int64`` flat rows of every layer of
    ``Pools.host_flat`` (layer-major)."""
    rows = rows.to(torch.int64)
    base = torch.arange(layers, dtype=torch.int64, device=rows.device) * num_rows
    return (base[None, :, None] + rows[:, None, :]).reshape(rows.shape[0], -1)


def device_flat_rows(rows: torch.Tensor, layers: int) -> torch.Tensor:
    """``[V, N]`` device row ids -> ``[V, layers * N] int64`` flat rows of
    ``Pools.device_flat`` (same order as ``host_flat_rows``)."""
    rows = rows.to(torch.int64)[:, None, :]
    layer = torch.arange(layers, dtype=torch.int64, device=rows.device)[None, :, None]
    flat = (rows // BLOCK_SIZE) * layers * BLOCK_SIZE + layer * BLOCK_SIZE + rows % BLOCK_SIZE
    return flat.reshape(rows.shape[0], -1)


@dataclass
class RowPlans:
    """``variants`` rotated plans of ``rows`` valid entries in ``[R, top_k]`` shape.

    ``src``/``dst``: ``[V, R, K] int32`` (-1 past ``counts``), ``counts``: ``[V, R] int32``,
    ``src_valid``/``dst_valid``: ``[V, rows] int64`` the valid ids in plan order (CPU)."""

    src: torch.Tensor
    dst: torch.Tensor
    counts: Optional[torch.Tensor]
    src_valid: torch.Tensor
    dst_valid: torch.Tensor

    @property
    def variants(self) -> int:
        return int(self.src.shape[0])

    @property
    def shape(self) -> tuple[int, int]:
        return int(self.src.shape[1]), int(self.src.shape[2])


def plan_geometry(rows: int, top_k: int, miss_ratio: float) -> tuple[int, int, list[int]]:
    """``(R, K, counts)``: ``rows`` misses as batch rows of ``round(miss_ratio * K)`` each
    (at least 1), the last row taking the remainder; ``K = top_k``."""
    per_row = max(1, min(top_k, round(miss_ratio * top_k)))
    num = -(-rows // per_row)
    counts = [per_row] * num
    counts[-1] = rows - per_row * (num - 1)
    return num, top_k, counts


def make_row_plans(rows: int, top_k: int, miss_ratio: float, src_rows_total: int,
                   dst_rows_total: int, device: torch.device, *, variants: int,
                   seed: int) -> RowPlans:
    """Random distinct source/destination rows, disjoint across the ``variants``."""
    num, width, counts = plan_geometry(rows, top_k, miss_ratio)
    gen = torch.Generator().manual_seed(seed)
    src_valid = torch.randperm(src_rows_total, generator=gen)[:variants * rows].view(variants,
                                                                                     rows)
    dst_valid = torch.randperm(dst_rows_total, generator=gen)[:variants * rows].view(variants,
                                                                                     rows)
    # Position of valid entry j in the flattened [R, K] plan.
    counts_t = torch.tensor(counts, dtype=torch.int64)
    row_of = torch.repeat_interleave(torch.arange(num), counts_t)
    starts = torch.cumsum(counts_t, 0) - counts_t
    col_of = torch.arange(rows) - starts[row_of]
    flat_pos = row_of * width + col_of
    src = torch.full((variants, num * width), -1, dtype=torch.int32)
    dst = torch.full((variants, num * width), -1, dtype=torch.int32)
    src[:, flat_pos] = src_valid.to(torch.int32)
    dst[:, flat_pos] = dst_valid.to(torch.int32)
    counts_v = torch.tensor(counts, dtype=torch.int32).expand(variants, num).contiguous()
    return RowPlans(src=src.view(variants, num, width).to(device),
                    dst=dst.view(variants, num, width).to(device),
                    counts=counts_v.to(device), src_valid=src_valid, dst_valid=dst_valid)


def make_page_plans(pages: int, src_blocks_total: int, dst_blocks_total: int,
                    device: torch.device, *, variants: int, seed: int) -> RowPlans:
    """``[V, 1, pages]`` block plans (no counts), disjoint across the variants."""
    gen = torch.Generator().manual_seed(seed)
    src_valid = torch.randperm(src_blocks_total, generator=gen)[:variants * pages]
    dst_valid = torch.randperm(dst_blocks_total, generator=gen)[:variants * pages]
    src_valid = src_valid.view(variants, pages)
    dst_valid = dst_valid.view(variants, pages)
    return RowPlans(src=src_valid.to(torch.int32).view(variants, 1, pages).to(device),
                    dst=dst_valid.to(torch.int32).view(variants, 1, pages).to(device),
                    counts=None, src_valid=src_valid, dst_valid=dst_valid)


class Rotation:
    """Calls ``fn(i)`` for ``i = 0, 1, ..., n - 1, 0, ...``: each timed call uses the next
    buffer/plan of a rotation."""

    def __init__(self, n: int, fn: Callable[[int], Any]) -> None:
        self.n = max(1, n)
        self.fn = fn
        self.i = 0

    def __call__(self) -> Any:
        i = self.i
        self.i = (i + 1) % self.n
        return self.fn(i)


def _variants(pool_units: int, units: int, plan_bytes_each: int, max_plan_bytes: int) -> int:
    return max(1, min(pool_units // max(units, 1), max_plan_bytes // max(plan_bytes_each, 1)))


# --------------------------------------------------------------------------- measurement

@dataclass
class Figure:
    """One measured point (one JSON record of ``transfers`` or ``resolve``)."""

    op: str
    method: str
    time_us: Optional[float]
    params: dict[str, Any]
    gbps: Optional[float] = None
    vs_eager: Optional[float] = None
    vs_contiguous: Optional[float] = None
    vs_torch: Optional[float] = None
    verified: Optional[bool] = None
    error: Optional[str] = None
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"op": self.op, "method": self.method, **self.params,
                               "time_us": _round(self.time_us)}
        for name in ("gbps", "vs_eager", "vs_contiguous", "vs_torch"):
            value = getattr(self, name)
            if value is not None:
                out[name] = _round(value)
        if self.verified is not None:
            out["verified"] = self.verified
        if self.error is not None:
            out["error"] = self.error
        out.update(self.extra)
        return out


def _round(value: Optional[float]) -> Optional[float]:
    if value is None or not math.isfinite(value):
        return value
    return float(f"{value:.4g}")


def _ops_module() -> Any:
    from hisparse_triton import ops

    return ops


class _Bench:
    """State of one ``run_bench`` call."""

    def __init__(self, settings: BenchSettings, device: torch.device,
                 progress: Optional[Progress]) -> None:
        self.s = settings
        self.device = device
        self.cuda = device.type == "cuda"
        self.progress = progress
        self.flush = _L2Flush(device, settings.rotate_bytes if self.cuda else 0)
        self.methods = [m for m in settings.methods if self.cuda or m != "triton"]

    def _time(self, fn: Callable[[], Any], *, host_part: bool) -> float:
        if self.cuda and not host_part:
            return device_time_ms(fn, warmup_ms=self.s.warmup_ms, rep_ms=self.s.rep_ms)
        return wall_time_ms(fn, self.device, warmup_ms=self.s.warmup_ms, rep_ms=self.s.rep_ms,
                            flush=self.flush)

    def _step(self, note: str) -> None:
        if self.progress is not None:
            self.progress.step(note)

    # ---- transfers

    def transfer_group(self, row_bytes: int, layers: int, figures: list[Figure]) -> None:
        """Append every transfer figure of one (row size, layers) pair to ``figures`` (as
        they are measured: an interrupted run keeps them); one pair of pools."""
        s = self.s
        ops = [op for op in s.ops if op in TRANSFER_OPS]
        rows_max = max(s.rows)
        rotate_rows = -(-s.rotate_bytes // (row_bytes * layers))
        pools = make_pools(row_bytes, layers, max(rows_max, rotate_rows), self.device,
                           seed=s.seed)
        for rows in s.rows:
            base = {"row_bytes": row_bytes, "rows": rows, "layers": layers}
            baseline: dict[tuple[Any, ...], float] = {}
            for op in ops:
                if op in PAGE_OPS and rows < BLOCK_SIZE:
                    continue
                ratios = s.miss_ratios if op in ("gather", "backup") else (None,)
                for i, ratio in enumerate(ratios):
                    params = {**base, "miss_ratio": ratio}
                    figures += self.transfer_case(op, params, pools, baseline,
                                                  with_baselines=i == 0)

    def transfer_case(self, op: str, params: dict[str, Any], pools: Pools,
                      baseline: dict[tuple[Any, ...], float], *,
                      with_baselines: bool) -> list[Figure]:
        """Figures of one op at one size and miss ratio. Baselines (which do not depend on the
        miss ratio) are measured once per op and size: ``with_baselines``; their timings are
        kept in ``baseline`` (the contiguous copy is shared by ops of the same direction)."""
        s = self.s
        rows, ratio = params["rows"], params["miss_ratio"]
        nbytes = rows * pools.layers * pools.row_bytes
        direction = DIRECTION[op]
        seed = s.seed + rows
        if op in PAGE_OPS:
            pages = rows // BLOCK_SIZE
            nbytes = pages * BLOCK_SIZE * pools.layers * pools.row_bytes
            blocks = pools.num_rows // BLOCK_SIZE
            v = _variants(blocks, pages, pages * 8, s.max_plan_bytes)
            plans = make_page_plans(pages, blocks, blocks, self.device, variants=v, seed=seed)
            params = {**params, "rows": pages * BLOCK_SIZE, "pages": pages}
        else:
            num, width, _ = plan_geometry(rows, s.top_k, ratio)
            v = _variants(pools.num_rows, rows, num * width * 8 + rows * 16, s.max_plan_bytes)
            plans = make_row_plans(rows, s.top_k, ratio, pools.num_rows, pools.num_rows,
                                   self.device, variants=v, seed=seed)
        params = {**params, "bytes": nbytes, "plan": list(plans.shape), "rotation": v}
        if direction == "h2d":
            dst_t, src_t = pools.device, pools.host
        else:
            dst_t, src_t = pools.host, pools.device
        figures: list[Figure] = []
        contig_key = ("contiguous", direction, nbytes)
        eager_key = ("eager", op)
        for method in self.methods:
            if method in BASELINES and not with_baselines:
                continue
            key = contig_key if method == "contiguous" else eager_key if method == "eager" \
                else None
            fig_params = {**params, "miss_ratio": None} if key is not None else params
            note = f"{op} {pools.row_bytes}B x{rows} L{pools.layers} {method}"
            if key is not None and key in baseline:
                ms = baseline[key]
                figures.append(Figure(op, method, ms * 1e3, fig_params, gbps=gbps(nbytes, ms)))
                self._step(note)
                continue
            ok: Optional[bool] = None
            try:
                if method == "contiguous":
                    ms = self._contiguous(direction, nbytes, pools)
                elif method == "eager":
                    ms, ok = self._eager(op, plans, pools)
                else:
                    ms, ok = self._kernel(op, method, plans, pools, dst_t, src_t)
            except Exception as exc:  # noqa: BLE001 - one failing method must not end the run
                figures.append(Figure(op, method, None, fig_params,
                                      error=f"{type(exc).__name__}: {exc}"))
                self._step(note)
                continue
            if key is not None:
                baseline[key] = ms
            figures.append(Figure(op, method, ms * 1e3, fig_params, gbps=gbps(nbytes, ms),
                                  verified=ok, error=None if ok or ok is None else
                                  "moved rows differ from the source rows"))
            self._step(note)
        for fig in figures:
            if fig.gbps is None:
                continue
            eager = baseline.get(eager_key)
            contig = baseline.get(contig_key)
            if eager is not None:
                fig.vs_eager = fig.gbps / gbps(nbytes, eager)
            if contig is not None:
                fig.vs_contiguous = fig.gbps / gbps(nbytes, contig)
        return figures

    def _contiguous(self, direction: str, nbytes: int, pools: Pools) -> float:
        host = pools.host.pool
        dev = pools.device.pool
        windows = max(1, host.numel() // nbytes)

        def copy(i: int) -> None:
            lo = i * nbytes
            if direction == "h2d":
                dev[lo:lo + nbytes].copy_(host[lo:lo + nbytes], non_blocking=True)
            else:
                host[lo:lo + nbytes].copy_(dev[lo:lo + nbytes], non_blocking=True)

        return self._time(Rotation(windows, copy), host_part=False)

    def _indices(self, op: str, plans: RowPlans, pools: Pools, variants: slice = slice(None)
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(host_idx, device_idx, host_view, device_view)``: ``[V, L * n] int64`` flat
        indices of the moved units (rows, or pages) of ``variants`` into the 2-D views
        ``host_view`` / ``device_view`` (``host_idx`` on the CPU, ``device_idx`` on the
        device), in the same order on both sides."""
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
        return host_idx, dev_idx.to(self.device), host_view, dev_view

    def _scribble(self, op: str, plans: RowPlans, pools: Pools, variant: int) -> None:
        """Overwrite the destination units of ``variant`` with the complement of their
        expected bytes, so a check after the copy cannot pass on stale data."""
        host_idx, dev_idx, host_view, dev_view = self._indices(op, plans, pools,
                                                               slice(variant, variant + 1))
        if DIRECTION[op] == "h2d":
            expected = host_view.index_select(0, host_idx[0]).to(self.device)
            dev_view.index_copy_(0, dev_idx[0], torch.bitwise_not(expected))
        else:
            expected = dev_view.index_select(0, dev_idx[0]).cpu()
            host_view.index_copy_(0, host_idx[0], torch.bitwise_not(expected))
        _sync(self.device)

    def _eager(self, op: str, plans: RowPlans, pools: Pools) -> tuple[float, Optional[bool]]:
        host_idx, dev_idx, host_view, dev_view = self._indices(op, plans, pools)
        n, width = host_idx.shape[1], host_view.shape[1]
        staging_host = _alloc_host(n * width, self.device).view(n, width)
        staging_dev = torch.empty(n, width, dtype=torch.uint8, device=self.device)

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

        ok: Optional[bool] = None
        if self.s.verify:
            self._scribble(op, plans, pools, 0)
            run(0)
            _sync(self.device)
            ok = self._check(op, plans, pools, 0)
        return self._time(Rotation(plans.variants, run), host_part=True), ok

    def _kernel(self, op: str, method: str, plans: RowPlans, pools: Pools, dst_t: RowTable,
                src_t: RowTable) -> tuple[float, Optional[bool]]:
        ops = _ops_module()
        fn = ops.copy_pages if op in PAGE_OPS else ops.copy_rows
        counts = plans.counts

        def run(i: int) -> None:
            fn(dst_t, src_t, plans.src[i], plans.dst[i],
               None if counts is None else counts[i], backend=method)

        ok: Optional[bool] = None
        if self.s.verify:
            self._scribble(op, plans, pools, 0)
            run(0)
            _sync(self.device)
            ok = self._check(op, plans, pools, 0)
        ms = self._time(Rotation(plans.variants, run), host_part=method != "triton")
        return ms, ok

    def _check(self, op: str, plans: RowPlans, pools: Pools, variant: int) -> bool:
        """Do the destination rows of ``variant`` equal its source rows (every layer)?"""
        host_idx, dev_idx, host_view, dev_view = self._indices(op, plans, pools,
                                                               slice(variant, variant + 1))
        host_rows = host_view.index_select(0, host_idx[0])
        dev_rows = dev_view.index_select(0, dev_idx[0]).cpu()
        return bool(torch.equal(host_rows, dev_rows))

    # ---- resolve

    def resolve_case(self, batch: int, ratio: float) -> list[Figure]:
        s = self.s
        params = {"batch": batch, "top_k": s.top_k, "hot_slots": s.hot_slots,
                  "seq_len": s.seq_len, "miss_ratio": ratio}
        figures: list[Figure] = []
        work: Optional[ResolveWorkload] = None
        for method in [m for m in self.methods if m in KERNEL_METHODS]:
            note = f"resolve b{batch} k{s.top_k} h{s.hot_slots} {method}"
            try:
                if work is None:
                    work = ResolveWorkload(batch, s.top_k, s.hot_slots, s.seq_len, ratio,
                                           self.device, rotate_bytes=s.rotate_bytes
                                           if self.cuda else 0, seed=s.seed)
                work.reset()
                ms, measured = self._resolve(work, method)
            except Exception as exc:  # noqa: BLE001
                figures.append(Figure("resolve", method, None, params,
                                      error=f"{type(exc).__name__}: {exc}"))
                self._step(note)
                continue
            figures.append(Figure("resolve", method, ms * 1e3, params,
                                  extra={"measured_miss_ratio": _round(measured)}))
            self._step(note)
        torch_fig = next((f for f in figures if f.method == "torch" and f.time_us), None)
        if torch_fig is not None:
            for fig in figures:
                if fig.time_us:
                    fig.vs_torch = torch_fig.time_us / fig.time_us
        return figures

    def _resolve(self, work: "ResolveWorkload", method: str) -> tuple[float, float]:
        """``(median ms, measured miss ratio)`` of ``method`` on ``work`` (warmed first)."""
        ops = _ops_module()
        stats: list[torch.Tensor] = []
        collect = [False]

        def run(i: int) -> Any:
            out = ops.resolve(*work.args(i), **work.kwargs, backend=method)
            if collect[0]:
                stats.append(out.stats)
            return out

        rot = Rotation(work.calls_per_cycle, run)
        for _ in range(work.calls_per_cycle):  # every state set through every step: warm
            rot()
        collect[0] = True
        for _ in range(work.calls_per_cycle):
            rot()
        collect[0] = False
        total = torch.stack(stats).sum(dim=(0, 1)).cpu()
        hits, misses = int(total[0]), int(total[1])
        measured = misses / max(hits + misses, 1)
        return self._time(rot, host_part=method != "triton"), measured


class ResolveWorkload:
    """Decode-like resolve state for ``batch`` requests, rotated over ``sets`` disjoint sets
    of state rows (so the state touched spans more than ``rotate_bytes``) and ``steps`` top-k
    variants. Step ``t``'s top-k keeps ``1 - miss_ratio`` of step ``t - 1``'s positions (hits
    once warm) and draws the rest at random from the history, so the measured miss ratio
    approaches ``miss_ratio`` (reported as measured).

    Every request has ``seq_len`` tokens; its last 2 pages are resident, the rest host-only.
    """

    def __init__(self, batch: int, top_k: int, hot_slots: int, seq_len: int, miss_ratio: float,
                 device: torch.device, *, rotate_bytes: int = 0, seed: int = 0,
                 steps: int = 8) -> None:
        self.steps = steps
        B = BLOCK_SIZE
        pages = -(-seq_len // B)
        hot_blocks = -(-hot_slots // B)
        state_bytes = batch * hot_slots * 8
        self.sets = max(1, min(32, -(-rotate_bytes // max(state_bytes, 1))))
        S = batch * self.sets
        gen = torch.Generator().manual_seed(seed)
        self.seq_lens = torch.full((S,), seq_len, dtype=torch.int32)
        self.host_blocks = (1 + torch.arange(S * pages, dtype=torch.int32)).view(S, pages)
        resident = torch.zeros(S, pages, dtype=torch.int32)
        tail = min(2, pages)
        resident[:, pages - tail:] = (1 + torch.arange(S * tail, dtype=torch.int32)).view(S, tail)
        self.resident_blocks = resident
        self.hot_blocks = (1 + S * tail + torch.arange(S * hot_blocks, dtype=torch.int32)
                           ).view(S, hot_blocks)
        self.slot_host_rows = torch.empty(S, hot_slots, dtype=torch.int32)
        self.lru = torch.empty(S, hot_slots, dtype=torch.int32)
        self._hot_slots = hot_slots
        self.kwargs = {"block_size": B, "num_device_blocks": 1 + S * (tail + hot_blocks),
                       "num_host_blocks": 1 + S * pages}
        keep = int(round((1 - miss_ratio) * top_k))
        topks = []
        current = torch.rand(batch, seq_len, generator=gen).argsort(dim=1)[:, :top_k]
        for _ in range(self.steps):
            # Keep `keep` random columns of the previous step; draw the rest from the
            # positions not kept (random scores, kept ones pushed last); shuffle the row.
            order = torch.rand(batch, top_k, generator=gen).argsort(dim=1)[:, :keep]
            kept = current.gather(1, order)
            scores = torch.rand(batch, seq_len, generator=gen)
            scores.scatter_(1, kept, 2.0)
            fresh = scores.topk(top_k - keep, dim=1, largest=False).indices
            nxt = torch.cat([kept, fresh], dim=1)
            nxt = nxt.gather(1, torch.rand(batch, top_k, generator=gen).argsort(dim=1))
            topks.append(nxt.to(torch.int32))
            current = nxt
        to = (lambda t: t.to(device))
        self.topk = [to(t) for t in topks]
        self.state_rows = [to(torch.arange(k * batch, (k + 1) * batch, dtype=torch.int32))
                           for k in range(self.sets)]
        for name in ("seq_lens", "host_blocks", "resident_blocks", "hot_blocks",
                     "slot_host_rows", "lru"):
            setattr(self, name, to(getattr(self, name)))
        self.reset()

    def reset(self) -> None:
        """Empty hot buffers (every slot -1, LRU order = slot order)."""
        self.slot_host_rows.fill_(-1)
        self.lru.copy_(torch.arange(self._hot_slots, dtype=torch.int32,
                                    device=self.lru.device).expand_as(self.lru))

    @property
    def calls_per_cycle(self) -> int:
        return self.sets * self.steps

    def args(self, i: int) -> tuple[torch.Tensor, ...]:
        """Call ``i``: state set ``i % sets`` at step ``(i // sets) % steps``."""
        return (self.topk[(i // self.sets) % self.steps], self.state_rows[i % self.sets],
                self.seq_lens, self.resident_blocks, self.host_blocks, self.hot_blocks,
                self.slot_host_rows, self.lru)


# --------------------------------------------------------------------------- driver

def count_steps(settings: BenchSettings, device: torch.device) -> int:
    """Progress steps of ``run_bench`` (one per measured figure)."""
    methods = [m for m in settings.methods if device.type == "cuda" or m != "triton"]
    n = 0
    for rows in settings.rows:
        for op in settings.ops:
            if op not in TRANSFER_OPS or (op in PAGE_OPS and rows < BLOCK_SIZE):
                continue
            ratios = len(settings.miss_ratios) if op in ("gather", "backup") else 1
            n += ratios * len([m for m in methods if m in KERNEL_METHODS])
            n += len([m for m in methods if m in BASELINES])
    n *= len(settings.row_bytes) * len(settings.layers)
    if "resolve" in settings.ops:
        n += (len(settings.batch) * len(settings.miss_ratios)
              * len([m for m in methods if m in KERNEL_METHODS]))
    return n


def run_bench(settings: BenchSettings, device: Optional[torch.device] = None, *,
              progress: Optional[Progress] = None) -> dict[str, Any]:
    """Run the sweep on ``device`` (default: CUDA when present, else CPU); the JSON result."""
    settings.validate()
    if device is None:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    bench = _Bench(settings, device, progress)
    started = time.time()
    transfers: list[Figure] = []
    resolves: list[Figure] = []
    interrupted = False
    try:
        if any(op in TRANSFER_OPS for op in settings.ops):
            for row_bytes in settings.row_bytes:
                for layers in settings.layers:
                    bench.transfer_group(row_bytes, layers, transfers)
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
        if "resolve" in settings.ops:
            for batch in settings.batch:
                for ratio in settings.miss_ratios:
                    resolves += bench.resolve_case(batch, ratio)
    except KeyboardInterrupt:
        interrupted = True  # keep what was measured
    kernel_timings = device.type == "cuda" and "triton" in settings.methods
    notes = []
    if device.type != "cuda":
        notes.append(KERNELS_NEED_GPU)
    if interrupted:
        notes.append("interrupted: the sweep stopped early, these are the figures measured "
                     "before")
    result = {
        "schema": SCHEMA,
        "version": VERSION,
        "device": str(device),
        "kernel_timings": kernel_timings,
        "interrupted": interrupted,
        "notes": notes,
        "environment": environment(),
        "settings": {k: list(v) if isinstance(v, tuple) else v
                     for k, v in asdict(settings).items()},
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(started)),
        "wall_s": round(time.time() - started, 3),
        "transfers": [f.to_json() for f in transfers],
        "resolve": [f.to_json() for f in resolves],
    }
    result["targets"] = evaluate_targets(result)
    return result


# --------------------------------------------------------------------------- targets

#: DESIGN.md section 9 targets (H200).
TARGET_GATHER_GBPS = 45.0
TARGET_GATHER_VS_CONTIGUOUS = 0.8
TARGET_BACKUP_GBPS = 45.0
TARGET_RESOLVE_US = 15.0
TARGET_VS_EAGER = 10.0
TARGET_ROW_BYTES = 656
TARGET_MIN_ROWS = 4096


def evaluate_targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Where each DESIGN.md section 9 target stands in ``result`` (the worst case over the
    matching figures; ``status`` ``met`` / ``missed`` / ``not measured``)."""
    tr = [f for f in result.get("transfers", [])
          if f.get("method") == "triton" and f.get("gbps") is not None
          and f.get("row_bytes") == TARGET_ROW_BYTES and f.get("rows", 0) >= TARGET_MIN_ROWS]
    gather = [f for f in tr if f["op"] == "gather"]
    backup = [f for f in tr if f["op"] == "backup"]
    res = [f for f in result.get("resolve", []) if f.get("method") == "triton"
           and f.get("time_us") is not None and f.get("batch") == 64
           and f.get("top_k") == 2048 and f.get("hot_slots") == 4096]
    targets: list[dict[str, Any]] = []

    def add(name: str, values: list[float], target: float, *, higher: bool, unit: str) -> None:
        if not values:
            targets.append({"target": name, "goal": target, "unit": unit,
                            "status": "not measured"})
            return
        worst = min(values) if higher else max(values)
        ratio = worst / target if higher else target / worst
        targets.append({"target": name, "goal": target, "unit": unit, "worst": _round(worst),
                        "best": _round(max(values) if higher else min(values)),
                        "ratio": _round(ratio), "cases": len(values),
                        "status": "met" if ratio >= 1 else "missed"})

    add("gather GB/s, 656 B rows, >= 4k rows", [f["gbps"] for f in gather],
        TARGET_GATHER_GBPS, higher=True, unit="GB/s")
    add("gather / contiguous pinned copy, 656 B rows, >= 4k rows",
        [f["vs_contiguous"] for f in gather if "vs_contiguous" in f],
        TARGET_GATHER_VS_CONTIGUOUS, higher=True, unit="x")
    add("backup GB/s, 656 B rows, >= 4k rows", [f["gbps"] for f in backup],
        TARGET_BACKUP_GBPS, higher=True, unit="GB/s")
    add("resolve latency, 64 x 2048 x 4096", [f["time_us"] for f in res],
        TARGET_RESOLVE_US, higher=False, unit="us")
    add("gather and backup vs torch eager, 656 B rows, >= 4k rows",
        [f["vs_eager"] for f in gather + backup if "vs_eager" in f],
        TARGET_VS_EAGER, higher=True, unit="x")
    add("resolve vs torch reference, 64 x 2048 x 4096",
        [f["vs_torch"] for f in res if "vs_torch" in f], TARGET_VS_EAGER, higher=True,
        unit="x")
    return targets


# --------------------------------------------------------------------------- output

def _fmt(value: Any, spec: str = ".3g") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return format(value, spec)
    return str(value)


def format_table(result: dict[str, Any]) -> str:
    """The human-readable report of a ``run_bench`` result."""
    lines: list[str] = []
    env = result.get("environment", {})
    where = env.get("gpu") or f"CPU ({env.get('cpu') or 'unknown'})"
    lines.append(f"hisparse-triton bench on {where}: torch {env.get('torch')}, "
                 f"triton {env.get('triton')}" +
                 (f", driver {env['driver']}" if env.get("driver") else ""))
    for note in result.get("notes", []):
        lines.append(f"NOTE: {note}.")
    transfers = result.get("transfers", [])
    if transfers:
        lines.append("")
        lines.append("Transfers (GB/s of payload; x eager / x contig = ratio to the torch-eager "
                     "and contiguous pinned copy baselines)")
        header = (f"{'op':<10}{'row B':>6}{'rows':>8}{'L':>3}{'miss':>7}  {'method':<11}"
                  f"{'time us':>10}{'GB/s':>9}{'x eager':>9}{'x contig':>9}  note")
        lines.append(header)
        lines.append("-" * len(header))
        for f in transfers:
            note = f.get("error") or ("" if f.get("verified", True) else "UNVERIFIED")
            lines.append(
                f"{f['op']:<10}{f['row_bytes']:>6}{f['rows']:>8}{f['layers']:>3}"
                f"{_fmt(f.get('miss_ratio'), '.3g'):>7}  {f['method']:<11}{_fmt(f.get('time_us'), '.1f'):>10}"
                f"{_fmt(f.get('gbps'), '.2f'):>9}{_fmt(f.get('vs_eager'), '.2f'):>9}"
                f"{_fmt(f.get('vs_contiguous'), '.2f'):>9}  {note}")
    resolves = result.get("resolve", [])
    if resolves:
        lines.append("")
        lines.append("Resolve latency (x torch = speed-up over the torch reference)")
        header = (f"{'batch':>6}{'top_k':>7}{'hot':>7}{'miss':>7}{'meas.':>7}  {'method':<8}"
                  f"{'time us':>10}{'x torch':>9}  note")
        lines.append(header)
        lines.append("-" * len(header))
        for f in resolves:
            lines.append(
                f"{f['batch']:>6}{f['top_k']:>7}{f['hot_slots']:>7}{f['miss_ratio']:>7.3g}"
                f"{_fmt(f.get('measured_miss_ratio'), '.3f'):>7}  {f['method']:<8}"
                f"{_fmt(f.get('time_us'), '.1f'):>10}{_fmt(f.get('vs_torch'), '.2f'):>9}  "
                f"{f.get('error') or ''}")
    targets = result.get("targets", [])
    if targets and result.get("kernel_timings"):
        lines.append("")
        lines.append("DESIGN.md section 9 targets (worst case over matching figures)")
        for t in targets:
            if t["status"] == "not measured":
                lines.append(f"  {t['target']}: not measured")
            else:
                lines.append(f"  {t['target']}: {t['worst']} {t['unit']} vs goal {t['goal']} "
                             f"-> {t['ratio']:.2f} of target, {t['status']}")
    lines.append("")
    lines.append(f"({result.get('wall_s', 0):.1f} s on {result.get('device')})")
    return "\n".join(lines)


class MissingPlotDependency(RuntimeError):
    """``--plot`` needs matplotlib (the ``bench`` extra)."""


def write_plot(result: dict[str, Any], path: str) -> None:
    """PNG of GB/s vs rows moved, one line per method (and layer count), one panel per
    (op, row size); the largest miss ratio of the run for the kernel methods."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise MissingPlotDependency(
            "--plot needs matplotlib: pip install 'hisparse-triton[bench]' "
            "(or pip install matplotlib)") from exc
    figs = [f for f in result.get("transfers", []) if f.get("gbps") is not None]
    if not figs:
        raise ValueError("--plot needs transfer figures, and this run measured none.")
    panels = sorted({(f["op"], f["row_bytes"]) for f in figs},
                    key=lambda p: (TRANSFER_OPS.index(p[0]), p[1]))
    ops_ = sorted({p[0] for p in panels}, key=TRANSFER_OPS.index)
    sizes = sorted({p[1] for p in panels})
    fig, axes = plt.subplots(len(ops_), len(sizes), figsize=(4.2 * len(sizes), 3.2 * len(ops_)),
                             squeeze=False)
    title_env = result.get("environment", {})
    fig.suptitle(f"hisparse-triton bench: {title_env.get('gpu') or 'CPU'} "
                 f"(torch {title_env.get('torch')}, triton {title_env.get('triton')})")
    styles = {1: "-", 2: "--", 4: "-."}
    colors = {"triton": "tab:red", "torch": "tab:blue", "eager": "tab:gray",
              "contiguous": "tab:green"}
    for i, op in enumerate(ops_):
        for j, size in enumerate(sizes):
            ax = axes[i][j]
            mine = [f for f in figs if f["op"] == op and f["row_bytes"] == size]
            top_ratio = max((f["miss_ratio"] for f in mine if f["miss_ratio"] is not None),
                            default=None)
            lines: dict[tuple[str, int], list[tuple[int, float]]] = {}
            for f in mine:
                if f["method"] in KERNEL_METHODS and f["miss_ratio"] != top_ratio:
                    continue
                lines.setdefault((f["method"], f["layers"]), []).append((f["rows"], f["gbps"]))
            for (method, layers), pts in sorted(lines.items()):
                pts.sort()
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                        color=colors.get(method), linestyle=styles.get(layers, ":"),
                        label=f"{method} L={layers}")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{op}, {size} B rows", fontsize=9)
            ax.set_xlabel("rows moved")
            ax.set_ylabel("GB/s (log)")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=110)
    plt.close(fig)


def override(settings: BenchSettings, **changes: Any) -> BenchSettings:
    """``settings`` with the non-``None`` ``changes`` applied."""
    return replace(settings, **{k: v for k, v in changes.items() if v is not None})


def iter_figures(result: dict[str, Any]) -> Iterable[dict[str, Any]]:
    yield from result.get("transfers", [])
    yield from result.get("resolve", [])


__all__: Sequence[str] = (
    "BenchSettings", "Progress", "ResolveWorkload", "environment", "evaluate_targets",
    "format_table", "run_bench", "wall_time_ms", "device_time_ms", "write_plot",
)
