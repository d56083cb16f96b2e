"""The human-readable table of a ``run_bench`` result. Pure Python: no torch import."""

from __future__ import annotations

from typing import Any

from hisparse_triton.benchmarks.targets import target_lines


def _fmt(value: Any, spec: str = ".3g") -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return format(value, spec)
    return str(value)


def _note(f: dict[str, Any]) -> str:
    parts = []
    if f.get("verified") is False:
        parts.append("UNVERIFIED")
    elif f.get("error"):
        parts.append(f["error"])
    if f.get("launch_config") == "tuned":
        parts.append("tuned")
    return " ".join(parts)


def _spread(f: dict[str, Any]) -> Any:
    """Half the 20-80 percentile spread of a figure, in % of its median."""
    if f.get("time_us") and f.get("p20_us") is not None and f.get("p80_us") is not None:
        return 50 * (f["p80_us"] - f["p20_us"]) / f["time_us"]
    return None


def transfer_lines(transfers: list[dict[str, Any]]) -> list[str]:
    header = (f"{'op':<8}{'row B':>6}{'rows':>8}{'L':>3}{'miss':>7}  {'method':<13}"
              f"{'time us':>10}{'+-%':>5}{'GB/s':>9}{'x eager':>9}{'x contig':>9}  note")
    lines = ["", "Transfers (GB/s of payload; x eager / x contig = ratio to the torch-eager and "
             "contiguous pinned copy baselines; +-% = half the 20-80 percentile spread)",
             header, "-" * len(header)]
    for f in transfers:
        lines.append(
            f"{f['op']:<8}{f['row_bytes']:>6}{f['rows']:>8}{f['layers']:>3}"
            f"{_fmt(f.get('miss_ratio'), '.3g'):>7}  {f['method']:<13}"
            f"{_fmt(f.get('time_us'), '.1f'):>10}{_fmt(_spread(f), '.0f'):>5}"
            f"{_fmt(f.get('gbps'), '.2f'):>9}{_fmt(f.get('vs_eager'), '.2f'):>9}"
            f"{_fmt(f.get('vs_contiguous'), '.2f'):>9}  {_note(f)}")
    return lines


def resolve_lines(resolves: list[dict[str, Any]]) -> list[str]:
    header = (f"{'batch':>6}{'top_k':>7}{'hot':>7}{'miss':>7}{'meas.':>7}  {'method':<13}"
              f"{'time us':>10}{'+-%':>5}{'x torch':>9}  note")
    lines = ["", "Resolve latency (same warm state every call; meas. = the step's measured miss "
             "ratio; x torch = speed-up over the torch reference)", header, "-" * len(header)]
    for f in resolves:
        lines.append(
            f"{f['batch']:>6}{f['top_k']:>7}{f['hot_slots']:>7}{f['miss_ratio']:>7.3g}"
            f"{_fmt(f.get('measured_miss_ratio'), '.3f'):>7}  {f['method']:<13}"
            f"{_fmt(f.get('time_us'), '.1f'):>10}{_fmt(_spread(f), '.0f'):>5}"
            f"{_fmt(f.get('vs_torch'), '.2f'):>9}  {_note(f)}")
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
