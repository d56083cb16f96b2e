"""Where a result stands against the H200 performance targets (docs/benchmarking.md).

Each target is evaluated on the worst case over the figures it covers (``worst``; ``ratio`` =
worst / goal for throughput, goal / worst for latency: >= 1 means met). Transfer targets use
the ``triton`` figures launched with the built-in configs (``launch_config == "builtin"``);
figures with a tuned config, and the CUDA-graph replays, are reported next to them
(``tuned_*``, ``graph_*``) without changing the status. A figure judged not a result
(``trusted: false``, ``benchmarks.noise``) counts in no target, nor does a ratio to such a
baseline. Pure Python: no torch import.
"""

from __future__ import annotations

from typing import Any, Iterable, Optional

from hisparse_triton.benchmarks.registry import ROW_OPS

TARGET_GATHER_GBPS = 45.0
TARGET_GATHER_VS_CONTIGUOUS = 0.8
TARGET_BACKUP_GBPS = 45.0
TARGET_RESOLVE_US = 15.0
TARGET_VS_EAGER = 10.0
TARGET_ROW_BYTES = 656
TARGET_MIN_ROWS = 4096
TARGET_RESOLVE_SHAPE = {"batch": 64, "top_k": 2048, "hot_slots": 4096}

STATUS_MET, STATUS_MISSED, STATUS_NONE = "met", "missed", "not measured"


def _round(value: float) -> float:
    return float(f"{value:.4g}")


def _transfer(result: dict[str, Any], op: str, method: str, source: Optional[str]
              ) -> list[dict[str, Any]]:
    return [f for f in result.get("transfers", [])
            if f.get("op") == op and f.get("method") == method and f.get("gbps") is not None
            and f.get("row_bytes") == TARGET_ROW_BYTES
            and f.get("rows", 0) >= TARGET_MIN_ROWS and f.get("verified") is not False
            and f.get("trusted", True)
            and (source is None or f.get("launch_config", "builtin") == source)]


def _resolve(result: dict[str, Any], method: str) -> list[dict[str, Any]]:
    return [f for f in result.get("resolve", [])
            if f.get("method") == method and f.get("time_us") is not None
            and f.get("verified") is not False and f.get("trusted", True)
            and all(f.get(k) == v for k, v in TARGET_RESOLVE_SHAPE.items())]


def _stand(values: list[float], goal: float, higher: bool) -> dict[str, Any]:
    worst = min(values) if higher else max(values)
    ratio = worst / goal if higher else goal / worst
    return {"worst": _round(worst), "best": _round(max(values) if higher else min(values)),
            "ratio": _round(ratio), "cases": len(values)}


def _target(name: str, goal: float, unit: str, higher: bool, values: list[float],
            companions: Iterable[tuple[str, list[float]]] = ()) -> dict[str, Any]:
    entry: dict[str, Any] = {"target": name, "goal": goal, "unit": unit}
    if values:
        entry.update(_stand(values, goal, higher))
        entry["status"] = STATUS_MET if entry["ratio"] >= 1 else STATUS_MISSED
    else:
        entry["status"] = STATUS_NONE
    for prefix, more in companions:
        if more:
            stand = _stand(more, goal, higher)
            entry.update({f"{prefix}_{k}": v for k, v in stand.items() if k != "cases"})
    return entry


def _values(figs: list[dict[str, Any]], name: str) -> list[float]:
    """``name`` of every figure that has it, leaving out ratios to a baseline figure that
    was not a result (``untrusted_ratios``)."""
    return [f[name] for f in figs if f.get(name) is not None
            and name not in f.get("untrusted_ratios", ())]


def evaluate_targets(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Every performance target with ``status`` ``met`` / ``missed`` / ``not
    measured`` over the figures of ``result`` (a ``run_bench`` result, or several merged)."""

    def transfer(ops: tuple[str, ...], name: str, method: str = "triton",
                 source: Optional[str] = "builtin") -> list[float]:
        return [v for op in ops for v in _values(_transfer(result, op, method, source), name)]

    def companions(ops: tuple[str, ...], name: str) -> list[tuple[str, list[float]]]:
        return [("tuned", transfer(ops, name, "triton", "tuned")),
                ("graph", transfer(ops, name, "triton_graph", None))]

    rows = f"{TARGET_ROW_BYTES} B rows, >= {TARGET_MIN_ROWS // 1024}k rows"
    shape = "x".join(str(TARGET_RESOLVE_SHAPE[k]) for k in ("batch", "top_k", "hot_slots"))
    graph_us = _values(_resolve(result, "triton_graph"), "time_us")
    eager_us = _values(_resolve(result, "triton"), "time_us")
    latency = _target(f"resolve latency, {shape}", TARGET_RESOLVE_US, "us", False,
                      graph_us or eager_us, [("eager", eager_us)] if graph_us else [])
    latency["basis"] = "CUDA graph replay" if graph_us else "eager launches"
    targets = [
        _target(f"gather GB/s, {rows}", TARGET_GATHER_GBPS, "GB/s", True,
                transfer(("gather",), "gbps"), companions(("gather",), "gbps")),
        _target(f"gather / contiguous pinned copy, {rows}", TARGET_GATHER_VS_CONTIGUOUS, "x",
                True, transfer(("gather",), "vs_contiguous"),
                companions(("gather",), "vs_contiguous")),
        _target(f"backup GB/s, {rows}", TARGET_BACKUP_GBPS, "GB/s", True,
                transfer(("backup",), "gbps"), companions(("backup",), "gbps")),
        _target(f"gather and backup vs torch eager, {rows}", TARGET_VS_EAGER, "x", True,
                transfer(ROW_OPS, "vs_eager"), companions(ROW_OPS, "vs_eager")),
        latency,
        _target(f"resolve vs torch reference, {shape}", TARGET_VS_EAGER, "x", True,
                _values(_resolve(result, "triton"), "vs_torch"),
                [("graph", _values(_resolve(result, "triton_graph"), "vs_torch"))]),
    ]
    return targets


def target_lines(targets: list[dict[str, Any]]) -> list[str]:
    """One line per target: ``worst unit vs goal -> ratio of target, status`` plus the tuned /
    graph / eager companions."""
    lines = []
    for t in targets:
        if t["status"] == STATUS_NONE:
            lines.append(f"  {t['target']}: not measured")
            continue
        more = [f"{p} {t[p + '_worst']} ({t[p + '_ratio']:.2f})"
                for p in ("tuned", "graph", "eager") if p + "_worst" in t]
        basis = f" [{t['basis']}]" if t.get("basis") else ""
        lines.append(f"  {t['target']}{basis}: worst {t['worst']} {t['unit']} "
                     f"(best {t['best']}) vs goal {t['goal']} -> {t['ratio']:.2f} of target, "
                     f"{t['status'].upper()}"
                     + (f"; {', '.join(more)}" if more else ""))
    return lines
