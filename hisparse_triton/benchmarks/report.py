"""The human-readable table of a ``run_bench`` result. Pure Python: no torch import."""

from __future__ import annotations

from typing import Any

from hisparse_triton.benchmarks.noise import noise_lines, spread_pct
from hisparse_triton.benchmarks.targets import target_lines
from hisparse_triton.units import format_duration_us


def _fmt(value: Any, spec: str = ".3g") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return format(value, spec)
    return str(value)


def _note(f: dict[str, Any], measured: str = "") -> str:
    parts = []
    if f.get("verified") is False:
        parts.append("UNVERIFIED")
    elif f.get("error"):
        parts.append(f["error"])
    if f.get("trusted") is False:
        parts.append(f"NOT A RESULT ({'; '.join(f.get('untrusted', []))}): measured "
                     f"{format_duration_us(f.get('time_us'))}{measured} over {f.get('reps')} calls")
    elif f.get("untrusted_ratios"):
        parts.append("baseline not a result: no ratio to it")
    if f.get("launch_config") == "tuned":
        parts.append("tuned")
    return " ".join(parts)


def _shown(f: dict[str, Any], name: str, spec: str) -> str:
    """A figure's value as the table shows it: ``-`` when the figure or, for a ratio, its
    baseline is not a result (``benchmarks.noise``)."""
    if f.get("trusted") is False or name in f.get("untrusted_ratios", ()):
        return "-"
    if name == "time_us":
        return format_duration_us(f.get(name))
    return _fmt(f.get(name), spec)


def transfer_lines(transfers: list[dict[str, Any]]) -> list[str]:
    header = (f"{'op':<8}{'row B':>6}{'rows':>8}{'L':>3}{'miss':>7}  {'method':<13}"
              f"{'time':>10}{'+-%':>5}{'GB/s':>9}{'x eager':>9}{'x contig':>9}  note")
    lines = ["", "Transfers (time of one call; GB/s of payload; x eager / x contig = ratio to the "
             "torch-eager and contiguous pinned copy baselines; +-% = half the 20-80 percentile "
             "spread)", header, "-" * len(header)]
    for f in transfers:
        measured = f", {f['gbps']:.3g} GB/s" if f.get("gbps") is not None else ""
        lines.append(
            f"{f['op']:<8}{f['row_bytes']:>6}{f['rows']:>8}{f['layers']:>3}"
            f"{_fmt(f.get('miss_ratio'), '.3g'):>7}  {f['method']:<13}"
            f"{_shown(f, 'time_us', ''):>10}{_fmt(spread_pct(f), '.0f'):>5}"
            f"{_shown(f, 'gbps', '.2f'):>9}{_shown(f, 'vs_eager', '.2f'):>9}"
            f"{_shown(f, 'vs_contiguous', '.2f'):>9}  {_note(f, measured)}".rstrip())
    return lines


def resolve_lines(resolves: list[dict[str, Any]]) -> list[str]:
    header = (f"{'batch':>6}{'top_k':>7}{'hot':>7}{'miss':>7}{'meas.':>7}  {'method':<13}"
              f"{'time':>10}{'+-%':>5}{'x torch':>9}  note")
    lines = ["", "Resolve latency (one call from the same warm state every time; meas. = the "
             "step's measured miss ratio; x torch = speed-up over the torch reference)",
             header, "-" * len(header)]
    for f in resolves:
        lines.append(
            f"{f['batch']:>6}{f['top_k']:>7}{f['hot_slots']:>7}{f['miss_ratio']:>7.3g}"
            f"{_fmt(f.get('measured_miss_ratio'), '.3f'):>7}  {f['method']:<13}"
            f"{_shown(f, 'time_us', ''):>10}{_fmt(spread_pct(f), '.0f'):>5}"
            f"{_shown(f, 'vs_torch', '.2f'):>9}  {_note(f)}".rstrip())
    return lines


def format_table(result: dict[str, Any]) -> str:
    """The report of a ``run_bench`` result: environment, notes, transfers, resolve and, on a
    GPU run, where the H200 performance targets stand."""
    env = result.get("environment", {})
    where = env.get("gpu") or f"CPU ({env.get('cpu') or 'unknown'})"
    lines = [f"hisparse-triton bench on {where}: torch {env.get('torch')}, "
             f"triton {env.get('triton')}"
             + (f", driver {env['driver']}" if env.get("driver") else "")
             + (f", CUDA {env['cuda_runtime']}" if env.get("cuda_runtime") else "")
             + (f", {result['torch_threads']} torch CPU thread"
                f"{'s' if result['torch_threads'] != 1 else ''}"
                if result.get("torch_threads") else "")]
    lines += noise_lines(result)
    for note in result.get("notes", []):
        lines.append(f"NOTE: {note}.")
    if result.get("transfers"):
        lines += transfer_lines(result["transfers"])
    if result.get("resolve"):
        lines += resolve_lines(result["resolve"])
    targets = result.get("targets", [])
    if targets and result.get("kernel_timings"):
        lines += ["", "H200 performance targets (worst case over matching figures; ratio >= 1 "
                  "= met)"]
        lines += target_lines(targets)
    lines += ["", f"({result.get('wall_s', 0):.1f} s on {result.get('device')})"]
    return "\n".join(lines)
