"""What a benchmark sweep measures: the methods, and ``BenchSettings`` (the ops come from
``registry``).

No torch import at module level beyond what ``BenchSettings.for_device`` needs to read the L2
size of a CUDA device.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from hisparse_triton.benchmarks.registry import ALL_OPS, TRANSFER_OPS
from hisparse_triton.config import ACTIVE_TAIL_PAGES

#: ``schema`` / ``schema_version`` of the JSON ``bench`` writes (3: the version key is
#: ``schema_version``, as in every JSON document of the CLI).
SCHEMA = "hisparse-triton/bench"
VERSION = 3

#: Methods a user can ask for. ``triton_graph`` figures (CUDA-graph replay of the Triton
#: kernels) come with ``triton`` on CUDA unless ``BenchSettings.graph`` is false.
KERNEL_METHODS = ("triton", "torch")
BASELINES = ("eager", "contiguous")
METHODS = KERNEL_METHODS + BASELINES
GRAPH_METHOD = "triton_graph"

#: Rows per block (page) of the benchmark pools, as in the planner's layouts.
BLOCK_SIZE = 64
#: Pages at the tail of a request that stay resident on the device.
TAIL_PAGES = ACTIVE_TAIL_PAGES
#: Miss ratios of the published GLM-5.1 LRU curve: cold, buffer = k, buffer = 4k.
DEFAULT_MISS_RATIOS = (1.0, 0.3, 0.067)

KERNELS_NEED_GPU = ("kernel timings need a GPU: no CUDA device here, so only the torch "
                    "paths (reference, eager, contiguous copy) were timed")


@dataclass(frozen=True)
class BenchSettings:
    """One benchmark sweep. ``for_device`` gives the defaults of a device.

    - ``row_bytes``, ``rows``, ``layers``, ``miss_ratios``: the transfer sweep (rows moved per
      launch per layer; page cases move ``rows // 64`` pages and ignore ``miss_ratios``).
    - ``top_k``: plan width (columns per batch row) of the transfer plans and of resolve.
    - ``batch``, ``hot_slots``, ``seq_len``: the resolve sweep (``miss_ratios`` too).
    - ``ops``, ``methods``: what to run (``methods`` from ``METHODS``).
    - ``warmup_ms``, ``rep_ms``: timing budget per figure.
    - ``rotate_bytes``: the rotation of plans / buffers spans at least this many bytes, and
      the L2 flush before wall-clock calls writes this many.
    - ``max_plan_bytes``: cap on the memory spent on rotated plans per case.
    - ``verify``: check what every method moved / returned against the source / reference.
    - ``graph``: also time the Triton kernels replayed from a CUDA graph (CUDA only).
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
    methods: tuple[str, ...] = METHODS
    warmup_ms: float = 10.0
    rep_ms: float = 50.0
    rotate_bytes: int = 256 << 20
    max_plan_bytes: int = 64 << 20
    verify: bool = True
    graph: bool = True
    seed: int = 0

    @classmethod
    def for_device(cls, device: Any, *, quick: bool = False) -> "BenchSettings":
        """Defaults: the full sweep on CUDA, a tiny one on CPU; ``quick`` shrinks either."""
        if device.type == "cuda":
            import torch

            l2 = torch.cuda.get_device_properties(device).L2_cache_size
            rotate = max(2 * l2, 64 << 20)
            if quick:
                return cls(row_bytes=(656,), rows=(4096, 65536), layers=(1, 4),
                           miss_ratios=(1.0, 0.067), top_k=2048, batch=(64,), hot_slots=4096,
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
        if "resolve" in self.ops and self.seq_len < min_seq_len(self.top_k, self.hot_slots):
            raise ValueError(
                f"--seq-len={self.seq_len} is too short for resolve: it needs >= "
                f"{min_seq_len(self.top_k, self.hot_slots)} (hot slots + top-k positions "
                f"outside the resident tail pages, so that any miss ratio can be prescribed).")
        bad = [op for op in self.ops if op not in ALL_OPS]
        if bad or not self.ops:
            raise ValueError(f"unknown op(s) {bad!r}; choose from {', '.join(ALL_OPS)}.")
        bad = [m for m in self.methods if m not in METHODS]
        if bad or not self.methods:
            raise ValueError(f"unknown method(s) {bad!r}; choose from {', '.join(METHODS)}.")
        for name in ("warmup_ms", "rep_ms"):
            if not getattr(self, name) > 0:
                raise ValueError(f"--{name.replace('_', '-')} must be positive, "
                                 f"got {getattr(self, name)}.")


#: Verification compares at most this many bytes per case (``transfers.VERIFY_BYTES``).
_VERIFY_BYTES = 64 << 20
#: What torch and the interpreter take besides the sweep's own tensors.
_BASE_BYTES = 256 << 20


def host_memory_estimate(settings: BenchSettings) -> dict[str, int]:
    """Peak RAM of the transfer sweep run on the CPU (both pools are host memory there), in
    bytes, for its largest (row size, layers) pair: ``pools`` (source and destination pools of
    ``max(rows, rotation)`` rows per layer), ``staging`` (the eager baseline's staging copy of
    the largest case on both sides, and the torch backend's gathered rows), ``verify`` (the
    check's copies) and ``base`` (torch itself); ``total`` their sum. A CPU run of
    DeepSeek-V3.2's 61 layers at 4k rows of 656 B takes about 1.2 GiB."""
    worst = {"pools": 0, "staging": 0, "verify": 0}
    if any(op in TRANSFER_OPS for op in settings.ops):
        for row_bytes in settings.row_bytes:
            for layers in settings.layers:
                pool_rows = max(max(settings.rows), -(-settings.rotate_bytes
                                                      // (row_bytes * layers)))
                payload = max(settings.rows) * layers * row_bytes
                case = {"pools": 2 * pool_rows * layers * row_bytes, "staging": 3 * payload,
                        "verify": 4 * min(payload, _VERIFY_BYTES)}
                if sum(case.values()) > sum(worst.values()):
                    worst = case
    worst["plans"] = settings.max_plan_bytes
    worst["base"] = _BASE_BYTES
    worst["total"] = sum(worst.values())
    return worst


def min_seq_len(top_k: int, hot_slots: int) -> int:
    """Shortest request for which resolve's workload can prescribe any miss ratio: the hot
    buffer and a whole top-k of fresh positions fit outside the resident tail pages (one more
    page for a partial last page)."""
    return hot_slots + top_k + (TAIL_PAGES + 1) * BLOCK_SIZE


def override(settings: BenchSettings, **changes: Any) -> BenchSettings:
    """``settings`` with the non-``None`` ``changes`` applied."""
    return replace(settings, **{k: v for k, v in changes.items() if v is not None})
