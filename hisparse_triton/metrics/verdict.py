"""The live verdict: is HiSparse helping this workload, and what would ``advise`` pick now?
(no torch, no prometheus_client).

A running deployment knows its own miss rate: its counters (``hits``, ``misses``) over a
window of recent samples give the observed steady-state miss rate at its hot-buffer size.
``live_verdict`` feeds that rate to the advise model (``advisor.run_advise`` with an
``advisor.ObservedMissCurve`` instead of a synthetic trace): every formula is advise's, only
the miss rates come from the live counters. The deployment's own setting takes the observed
rate as it is; the other settings of the sweep take advise's default (calibrated) miss curve
rescaled through it (``reference_curve``): the observed level, the calibrated shape. The
result is the estimated throughput of the deployment's own setting against keeping every
layer on the GPU, and the setting advise recommends for this workload now.

Inputs beside the observed rate (``VerdictSettings``): the model (a preset: the planner's
geometry), the GPU and host budgets (default: the deployment's own pools, which describe the
preset only when the deployment runs the whole preset), the tokens per request (default: the
deployment's ``max_model_len``), the link speed (default ``link.DEFAULT_LINK_GBPS``, or the
gather figures of a GPU ``bench`` result) and the step model (``advisor.StepModel``: the
decode step's compute time by batch, given or advise's default). The sweep covers advise's
default hot-buffer sizes plus the deployment's own, at the deployment's block size (other
block sizes only when asked: the observed rate is then carried to them along the reference
curve too).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from hisparse_triton.advisor import (
    AdviseSettings,
    ObservedMissCurve,
    StepModel,
    TraceMissCurve,
    default_buffers,
    run_advise,
    trace_miss_curve,
)
from hisparse_triton.config import GIB
from hisparse_triton.link import DEFAULT_LINK_GBPS, DEFAULT_LINK_SOURCE
from hisparse_triton.presets import get_preset

@dataclass(frozen=True)
class Deployment:
    """What a verdict needs to know about the running deployment, read once from its
    worker: its block size, ``device_buffer_size``, top-k, query tokens per decode step
    (``max_decode_query_len``), ``max_model_len`` and the bytes of its device and host
    pools."""

    block_size: int
    device_buffer_size: int
    top_k: int
    mtp: int
    max_model_len: int
    device_pool_bytes: int
    host_pool_bytes: int

    @classmethod
    def of(cls, worker: Any) -> "Deployment":
        """The deployment a ``HiSparseWorker`` was built for."""
        kv, hisparse = worker.kv_cache_config, worker.config.hisparse
        return cls(block_size=int(worker.block_size),
                   device_buffer_size=int(worker.device_buffer_size),
                   top_k=int(hisparse.index_topk), mtp=int(hisparse.max_decode_query_len),
                   max_model_len=int(worker.max_model_len),
                   device_pool_bytes=int(kv.num_blocks) * int(kv.bytes_per_block),
                   host_pool_bytes=int(kv.hisparse_host_num_blocks)
                   * int(kv.hisparse_host_block_stride))


@dataclass(frozen=True)
class Observation:
    """Counters over a window of samples: ``hits`` and ``misses`` added between its first
    and last sample (or since the counters started, ``since_start``), over ``seconds`` and
    ``samples`` samples."""

    hits: int
    misses: int
    seconds: float
    samples: int
    since_start: bool

    @property
    def columns(self) -> int:
        """Valid top-k columns resolved in the window (``hits + misses``)."""
        return self.hits + self.misses

    @property
    def miss_rate(self) -> float:
        """``misses / (hits + misses)`` over the window (0.0 when nothing was resolved)."""
        return self.misses / self.columns if self.columns else 0.0


@dataclass(frozen=True)
class VerdictSettings:
    """The advise model's inputs beside the observed miss rate (module docstring).

    - ``preset``: the model's geometry (``presets.list_presets()``; None only until a
      caller that knows it fills it in, as ``simulate`` does with its preset).
    - ``gpu_memory_gib`` / ``host_pool_gib``: the budgets; None = the deployment's device
      pool / host pool.
    - ``context_len``: tokens per request; None = the deployment's ``max_model_len``.
    - ``link_gbps`` / ``link_source``: the host -> device gather speed and where it comes
      from; ``link_by_rows``: GB/s by rows per launch (``advisor.link_from_bench``), wins.
    - ``step``: the decode step's compute time by batch; ``overlap``: the share of the
      gathers hidden under it; ``max_batch``: a cap on requests decoded together.
    - ``buffers`` / ``block_sizes``: the sweep (default: advise's buffers and the
      deployment's own, at the deployment's block size; the deployment's setting is
      always included).
    """

    preset: Optional[str]
    gpu_memory_gib: Optional[float] = None
    host_pool_gib: Optional[float] = None
    context_len: Optional[int] = None
    link_gbps: float = DEFAULT_LINK_GBPS
    link_source: str = DEFAULT_LINK_SOURCE
    link_by_rows: Optional[Callable[[int], float]] = field(default=None, compare=False)
    step: StepModel = StepModel(source="default, an assumption: give your engine's")
    overlap: float = 0.0
    max_batch: Optional[int] = None
    buffers: Optional[tuple[int, ...]] = None
    block_sizes: Optional[tuple[int, ...]] = None

    def __post_init__(self) -> None:
        if self.preset is not None:
            get_preset(self.preset)  # ValueError naming the known presets
        for name in ("gpu_memory_gib", "host_pool_gib"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"VerdictSettings.{name} must be positive, got {value!r}.")
        if not self.link_gbps > 0:
            raise ValueError(f"VerdictSettings.link_gbps must be positive, got "
                             f"{self.link_gbps!r}.")
        if not 0.0 <= self.overlap <= 1.0:
            raise ValueError(f"VerdictSettings.overlap must be in [0, 1], got "
                             f"{self.overlap!r}.")


@dataclass(frozen=True)
class Verdict:
    """The live verdict (``live_verdict``).

    - ``miss_rate``, ``columns``: the observed steady-state miss rate and the top-k columns
      it was measured over; ``block_size``, ``device_buffer_size``: the deployment's setting.
    - ``tokens_per_s``, ``batch``: advise's estimate for that setting (None and 0 when it
      does not fit the budget: ``setting_error`` says why); ``all_gpu_tokens_per_s``,
      ``all_gpu_batch``: every layer on the GPU; ``speedup_vs_all_gpu``: their ratio
      (``inf`` when all-GPU cannot hold one request, None without an estimate).
    - ``recommended``: advise's recommendation (``mode`` ``"hisparse"`` or ``"all-gpu"``,
      ``block_size``, ``device_buffer_size``, ``tokens_per_s``, ...), or None.
    - ``text``: the verdict in one line; ``advice``: the whole advise payload (the sweep).
    """

    miss_rate: float
    columns: int
    block_size: int
    device_buffer_size: int
    tokens_per_s: Optional[float]
    batch: int
    all_gpu_tokens_per_s: float
    all_gpu_batch: int
    speedup_vs_all_gpu: Optional[float]
    recommended: Optional[dict[str, Any]]
    setting_error: Optional[str]
    link_gbps: float
    link_source: str
    text: str
    advice: dict[str, Any]

    @property
    def recommended_speedup_vs_all_gpu(self) -> Optional[float]:
        """The recommended setting's estimate / all-GPU's (1.0 when all-GPU is recommended;
        ``inf`` when all-GPU cannot hold one request; None without a recommendation)."""
        rec = self.recommended
        if rec is None:
            return None
        if rec["mode"] == "all-gpu":
            return 1.0
        gpu = self.all_gpu_tokens_per_s
        return rec["tokens_per_s"] / gpu if gpu else float("inf")

    def as_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (``advice`` included)."""
        return {"miss_rate": self.miss_rate, "columns": self.columns,
                "block_size": self.block_size, "device_buffer_size": self.device_buffer_size,
                "tokens_per_s": self.tokens_per_s, "batch": self.batch,
                "all_gpu_tokens_per_s": self.all_gpu_tokens_per_s,
                "all_gpu_batch": self.all_gpu_batch,
                "speedup_vs_all_gpu": self.speedup_vs_all_gpu,
                "recommended": self.recommended,
                "recommended_speedup_vs_all_gpu": self.recommended_speedup_vs_all_gpu,
                "setting_error": self.setting_error, "link_gbps": self.link_gbps,
                "link_source": self.link_source, "text": self.text, "advice": self.advice}


def sweep_buffers(deployment: Deployment, settings: VerdictSettings) -> tuple[int, ...]:
    """The hot-buffer sizes a verdict sweeps: ``settings.buffers`` or advise's default
    (``advisor.default_buffers``), with the deployment's own."""
    base = settings.buffers or default_buffers(deployment.mtp, deployment.top_k)
    return tuple(sorted({*base, deployment.device_buffer_size}))


def advise_settings(deployment: Deployment, settings: VerdictSettings) -> AdviseSettings:
    """The ``AdviseSettings`` of a verdict: ``settings`` with the deployment's defaults."""
    blocks = tuple(sorted({*(settings.block_sizes or ()), deployment.block_size}))
    gpu = settings.gpu_memory_gib or deployment.device_pool_bytes / GIB
    host = settings.host_pool_gib or deployment.host_pool_bytes / GIB
    return AdviseSettings(
        preset=settings.preset, gpu_memory_gib=gpu, host_pool_gib=host,
        context_len=settings.context_len or deployment.max_model_len,
        buffers=sweep_buffers(deployment, settings), block_sizes=blocks,
        top_k=deployment.top_k, link_gbps=settings.link_gbps,
        link_source=settings.link_source, step=settings.step, overlap=settings.overlap,
        mtp=deployment.mtp, max_batch=settings.max_batch, link_by_rows=settings.link_by_rows)


@functools.lru_cache(maxsize=8)
def reference_curve(top_k: int, context_len: int, mtp: int) -> TraceMissCurve:
    """The shape a live miss rate is carried along to other settings: advise's default
    miss curve (the calibrated synthetic trace, ``advisor.trace_miss_curve`` with
    ``AdviseSettings``' defaults) at this top-k, tokens per request and query tokens per
    step; built once per arguments (seconds for a 2,048 top-k), each setting replayed once."""
    return trace_miss_curve(AdviseSettings(top_k=top_k, mtp=mtp), top_k, context_len)


def live_verdict(observation: Observation, deployment: Deployment,
                 settings: VerdictSettings) -> Verdict:
    """The verdict of ``observation`` (module docstring). ``ValueError`` when the window
    resolved no top-k column (nothing to judge yet) or the advise model refuses the inputs
    (e.g. a context not longer than top-k)."""
    if settings.preset is None:
        raise ValueError("VerdictSettings.preset is not set: name the model's preset.")
    if observation.columns == 0:
        raise ValueError("no top-k column was resolved in the window yet: nothing to judge.")
    h0, b0, rate = deployment.device_buffer_size, deployment.block_size, observation.miss_rate
    window = ("since the counters started" if observation.since_start else
              f"over the last {observation.samples - 1} sample intervals")
    adv = advise_settings(deployment, settings)
    reference = reference_curve(deployment.top_k, adv.context_len, deployment.mtp)
    curve = ObservedMissCurve(
        ((h0, b0, rate),), reference,
        f"live counters: miss rate {100 * rate:.1f}% over {observation.columns:,} top-k "
        f"columns {window} at device_buffer_size {h0}, block size {b0}; other settings "
        f"along the {reference.source}'s curve, rescaled through it")
    advice = run_advise(adv, miss_curve=curve)
    row = next(r for r in advice["settings"] if r["block_size"] == deployment.block_size
               and r["device_buffer_size"] == h0)
    gpu = advice["all_gpu"]
    error = row.get("error")
    if error is None and row["batch"] == 0:
        error = "the budget holds no request of this setting"
    tokens = None if error is not None else row["tokens_per_s"]
    if tokens is None:
        speedup = None
    else:
        speedup = tokens / gpu["tokens_per_s"] if gpu["tokens_per_s"] else float("inf")
    verdict = Verdict(
        miss_rate=rate, columns=observation.columns, block_size=deployment.block_size,
        device_buffer_size=h0, tokens_per_s=tokens, batch=0 if tokens is None else row["batch"],
        all_gpu_tokens_per_s=gpu["tokens_per_s"], all_gpu_batch=gpu["batch"],
        speedup_vs_all_gpu=speedup, recommended=advice["recommended"], setting_error=error,
        link_gbps=advice["link_gbps"], link_source=advice["link_source"], text="",
        advice=advice)
    return _with_text(verdict, deployment)


def _ratio(x: Optional[float]) -> str:
    return "?" if x is None else ("inf" if x == float("inf") else f"{x:.2f}x")


def _with_text(v: Verdict, deployment: Deployment) -> Verdict:
    from dataclasses import replace

    a = v.advice
    gpu = (f"all-GPU cannot hold one request" if not v.all_gpu_batch else
           f"all-GPU {v.all_gpu_tokens_per_s:,.0f} tokens/s at batch {v.all_gpu_batch}")
    head = (f"HiSparse verdict: miss rate {100 * v.miss_rate:.1f}% (live, "
            f"{v.columns:,} top-k columns) at block {v.block_size} x buffer "
            f"{v.device_buffer_size}")
    if v.tokens_per_s is None:
        now = f"{head} does not fit the budget ({v.setting_error}); {gpu}"
    else:
        now = (f"{head} -> about {v.tokens_per_s:,.0f} tokens/s at batch {v.batch}, "
               f"{_ratio(v.speedup_vs_all_gpu)} {gpu}")
    rec = v.recommended
    if rec is None:
        pick = "advise would pick nothing: no setting fits the budget"
    elif rec["mode"] == "all-gpu":
        pick = (f"advise would pick all-GPU (no HiSparse): about {rec['tokens_per_s']:,.0f} "
                f"tokens/s")
    elif (rec["block_size"], rec["device_buffer_size"]) == (v.block_size,
                                                             v.device_buffer_size):
        pick = "advise would keep this setting"
    else:
        pick = (f"advise would pick block_size {rec['block_size']}, device_buffer_size "
                f"{rec['device_buffer_size']}: about {rec['tokens_per_s']:,.0f} tokens/s, "
                f"{_ratio(v.recommended_speedup_vs_all_gpu)} all-GPU")
    inputs = (f"[{a['preset']}, {a['gpu_memory_gib']:.3g} GiB GPU, {a['host_pool_gib']:.3g} "
              f"GiB host, {a['context_len']} tokens/request, link {a['link_gbps']:g} GB/s, "
              f"step {a['step_model']['text']}]")
    return replace(v, text=f"{now}; {pick} {inputs}")


__all__ = ["Deployment", "Observation", "Verdict", "VerdictSettings",
           "advise_settings", "live_verdict", "reference_curve", "sweep_buffers"]
