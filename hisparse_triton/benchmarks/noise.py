"""How far a ``bench`` run can trust its own figures.

A figure measured while other work shares the machine can be off by orders of magnitude (a
torch op split over two threads waits for a descheduled one at every call). The run measures
its own noise and judges every figure (``judge_result``):

- **spread**: half the 20-80 percentile range of the figure's timed calls, in % of its
  median; over ``SPREAD_LIMIT_PCT`` the calls disagree too much for the median to mean much;
- **CPU speed**: ``CpuProbe`` times a fixed piece of CPU work (a torch add of 1 MiB tensors,
  on the torch threads the sweep uses) just before and just after every figure; the fastest
  probe of the run is its idle reference, and a figure whose probe ran below
  ``CPU_SPEED_LIMIT`` of that speed was measured on a CPU busy with other work. Only figures
  timed by a host clock are judged this way (everything on a CPU; ``torch`` and ``eager`` on
  CUDA): CUDA events time the device, not the host;
- **load**: the machine's load average and CPU count at the start and the end of the run
  (``machine_load``), reported as context.

A figure that fails a test stays in the JSON (``trusted: false``, ``untrusted``: the
reasons) but is not printed as a result, counts in no performance target, and the ratios
other figures take to it are not shown either (``untrusted_ratios``). Pure Python besides
``CpuProbe`` (torch imported when a probe is made).
"""

from __future__ import annotations

import math
import os
import statistics
import time
from typing import Any, Iterable, Optional

#: A figure whose spread (half the 20-80 percentile range, % of the median) exceeds this is
#: not a result.
SPREAD_LIMIT_PCT = 25.0
#: A host-clocked figure whose CPU probe ran below this fraction of the run's idle reference
#: is not a result.
CPU_SPEED_LIMIT = 0.5
#: What the probe does, for the report.
PROBE_WHAT = "a torch add of two 1 MiB float32 tensors"
#: Baseline methods, and the ratio each one's figure anchors.
RATIO_BASELINES = {"eager": "vs_eager", "contiguous": "vs_contiguous", "torch": "vs_torch"}
#: Methods timed by CUDA events on a CUDA device (the rest by a host clock).
DEVICE_CLOCKED = ("triton", "triton_graph", "contiguous")


class CpuProbe:
    """A fixed piece of CPU work, timed: ``sample()`` runs it ``calls`` times and returns the
    median in us; ``idle_us`` is the fastest sample so far (the run's idle reference)."""

    def __init__(self, calls: int = 16, numel: int = 1 << 18) -> None:
        import torch

        self.calls = calls
        self.a = torch.ones(numel, dtype=torch.float32)
        self.b = torch.full((numel,), 2.0, dtype=torch.float32)
        self.out = torch.empty(numel, dtype=torch.float32)
        self.idle_us = math.inf
        self.slowest_us = 0.0
        self._add = torch.add

    def sample(self) -> float:
        """Median time of one probe call now, in us (also updates ``idle_us``)."""
        times = []
        for _ in range(self.calls):
            start = time.perf_counter()
            self._add(self.a, self.b, out=self.out)
            times.append((time.perf_counter() - start) * 1e6)
        median = statistics.median(times)
        self.idle_us = min(self.idle_us, median)
        self.slowest_us = max(self.slowest_us, median)
        return median

    def calibrate(self, samples: int = 5) -> None:
        """A few samples up front, so that the idle reference exists before the first
        figure."""
        for _ in range(samples):
            self.sample()

    def summary(self) -> dict[str, Any]:
        """The probe's figures for the result's ``noise``."""
        return {"what": PROBE_WHAT, "calls_per_sample": self.calls,
                "idle_us": _round(self.idle_us), "slowest_us": _round(self.slowest_us)}


def machine_load() -> dict[str, Any]:
    """``{"load_1min", "cpus"}``: the 1-minute load average (``None`` where the platform has
    none) and the CPUs this process may use."""
    try:
        load: Optional[float] = round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        load = None
    from hisparse_triton.commands.flags import available_cpus

    return {"load_1min": load, "cpus": available_cpus()}


def spread_pct(figure: dict[str, Any]) -> Optional[float]:
    """Half the 20-80 percentile spread of a figure record, in % of its median."""
    if figure.get("time_us") and figure.get("p20_us") is not None \
            and figure.get("p80_us") is not None:
        return 50 * (figure["p80_us"] - figure["p20_us"]) / figure["time_us"]
    return None


def host_clocked(device: str, method: str) -> bool:
    """Was a figure of ``method`` timed by a host clock (so a busy CPU slows it)?"""
    return not device.startswith("cuda") or method not in DEVICE_CLOCKED


def figure_reasons(figure: dict[str, Any], device: str, idle_us: float) -> list[str]:
    """Why a figure record is not a result (empty: it is one); sets its ``cpu_speed``."""
    reasons = []
    spread = spread_pct(figure)
    if spread is not None and spread > SPREAD_LIMIT_PCT:
        reasons.append(f"spread +-{spread:.0f}% > {SPREAD_LIMIT_PCT:g}%")
    probe = figure.get("probe_us")
    if probe and math.isfinite(idle_us):
        speed = min(1.0, idle_us / probe)
        figure["cpu_speed"] = _round(speed)
        if speed < CPU_SPEED_LIMIT and host_clocked(device, figure["method"]):
            reasons.append(f"the CPU ran at {percent(speed)} of its idle speed")
    return reasons


def _anchor(figure: dict[str, Any]) -> tuple[Any, ...]:
    """The case a figure belongs to: figures of one case share their baselines."""
    if figure["op"] == "resolve":
        return ("resolve", figure.get("batch"), figure.get("top_k"), figure.get("hot_slots"),
                figure.get("miss_ratio"))
    return (figure["op"], figure.get("row_bytes"), figure.get("rows"), figure.get("layers"))


def judge_result(result: dict[str, Any], probe: Optional[CpuProbe],
                 load_start: dict[str, Any]) -> None:
    """Judge every figure of a ``run_bench`` result in place (``trusted``, ``untrusted``,
    ``cpu_speed``, ``untrusted_ratios``) and add ``noise``: the limits, the probe, the load
    at the start and now, and how many figures are not results."""
    device = result.get("device", "cpu")
    idle = probe.idle_us if probe is not None else math.inf
    figures = list(result.get("transfers", [])) + list(result.get("resolve", []))
    untrusted_baselines = set()
    for figure in figures:
        if figure.get("time_us") is None:
            continue
        reasons = figure_reasons(figure, device, idle)
        figure["trusted"] = not reasons
        if reasons:
            figure["untrusted"] = reasons
            if figure["method"] in RATIO_BASELINES:
                untrusted_baselines.add((_anchor(figure), figure["method"]))
    for figure in figures:
        ratios = [ratio for method, ratio in RATIO_BASELINES.items()
                  if figure.get(ratio) is not None
                  and (_anchor(figure), method) in untrusted_baselines]
        if ratios:
            figure["untrusted_ratios"] = ratios
    count = sum(1 for f in figures if f.get("trusted") is False)
    result["noise"] = {
        "spread_limit_pct": SPREAD_LIMIT_PCT, "cpu_speed_limit": CPU_SPEED_LIMIT,
        "probe": probe.summary() if probe is not None else None,
        "load_start": load_start, "load_end": machine_load(),
        "untrusted_figures": count, "figures": sum(1 for f in figures
                                                    if f.get("time_us") is not None),
    }


def noise_lines(result: dict[str, Any]) -> list[str]:
    """The report's lines about the run's noise: the machine line (always) and, when some
    figures are not results, what that means."""
    noise = result.get("noise")
    if not noise:
        return []
    start, end = noise["load_start"], noise["load_end"]
    cpus = start.get("cpus")
    load = ("load average unknown" if start.get("load_1min") is None else
            f"1-minute load average {start['load_1min']:g} at the start, "
            f"{end.get('load_1min'):g} at the end")
    line = f"machine: {cpus} CPU{'s' if cpus != 1 else ''} for this process, {load}"
    probe = noise.get("probe")
    if probe and probe.get("idle_us") is not None and math.isfinite(probe["idle_us"]):
        slowest = probe["idle_us"] / probe["slowest_us"] if probe["slowest_us"] else 1.0
        line += (f"; CPU-speed probe ({probe['what']}): {probe['idle_us']:g} us idle (the "
                 f"fastest of this run), at worst {percent(slowest)} of that speed")
    lines = [line]
    if noise["untrusted_figures"]:
        busy = [x.get("load_1min") for x in (start, end)]
        busy_text = ("; the machine was busy (load above its CPU count)"
                     if any(x is not None and cpus and x > cpus for x in busy) else "")
        lines.append(
            f"NOT RESULTS: {noise['untrusted_figures']} of {noise['figures']} figures were "
            f"measured under noise (a spread over +-{noise['spread_limit_pct']:g}%, or a CPU "
            f"below {100 * noise['cpu_speed_limit']:.0f}% of its idle speed){busy_text}: their "
            f"rows show what was measured in the note only, and ratios to them are left out. "
            f"Rerun on an idle machine (on a CPU, --threads 1 suffers least from other work).")
    return lines


def percent(fraction: float) -> str:
    """``0.35`` -> ``35%``, ``0.0042`` -> ``0.42%``: two significant digits below 10%."""
    value = 100 * fraction
    return f"{value:.0f}%" if value >= 10 else f"{value:.2g}%"


def _round(value: float) -> Optional[float]:
    return float(f"{value:.4g}") if math.isfinite(value) else None


def trusted(figures: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """The figure records that are results (judged trusted, or never judged)."""
    return [f for f in figures if f.get("trusted", True)]
