"""``--plot``: PNGs of ``bench`` (GB/s against rows moved) and ``advise`` (the sweep); they
need matplotlib, the ``bench`` extra."""

from __future__ import annotations

from typing import Any

from hisparse_triton.benchmarks.registry import TRANSFER_OPS
from hisparse_triton.benchmarks.settings import KERNEL_METHODS


class MissingPlotDependency(RuntimeError):
    """``--plot`` needs matplotlib (the ``bench`` extra)."""


def plot_available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the Agg backend, or ``MissingPlotDependency``."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise MissingPlotDependency(
            "--plot needs matplotlib: pip install 'hisparse-triton[bench]' "
            "(or pip install matplotlib)") from exc
    return plt


def _title(fig: Any, text: str, width_in: float) -> float:
    """``text`` as the figure's title, wrapped to the figure's width (about 11 characters an
    inch at the title's size); returns the top of the panels' area, below the title."""
    import textwrap

    lines = textwrap.wrap(text, width=max(30, int(width_in * 11)))
    fig.suptitle("\n".join(lines), fontsize=10)
    height_in = fig.get_size_inches()[1]
    return max(0.5, 1.0 - (0.16 * len(lines) + 0.05) / height_in)


#: What each method is, for the legend.
METHOD_LABELS = {
    "triton": "triton: the Triton kernel, one launch per call",
    "triton_graph": "triton_graph: the Triton kernel replayed from a CUDA graph",
    "torch": "torch: the op's torch backend",
    "eager": "eager (baseline): index_select + one copy + index_copy_",
    "contiguous": "contiguous (baseline): one pinned copy of the same bytes, the link ceiling",
}
METHOD_COLORS = {"triton": "tab:red", "triton_graph": "tab:orange", "torch": "tab:blue",
                 "eager": "tab:gray", "contiguous": "tab:green"}
LAYER_STYLES = {1: "-", 2: "--", 4: "-."}


def count_label(value: float, _pos: Any = None) -> str:
    """A tick label for a row count: ``512``, ``4k``, ``256k``, ``1M``."""
    if value >= 1 << 20 and value % (1 << 20) == 0:
        return f"{int(value) >> 20}M"
    if value >= 1024 and value % 1024 == 0:
        return f"{int(value) >> 10}k"
    return f"{value:g}"


def plain_label(value: float, _pos: Any = None) -> str:
    """A tick label on a log axis as a plain number (``0.1``, ``2``, ``50``), not ``10^1``."""
    return f"{value:g}"


def what_was_timed(result: dict[str, Any], figs: list[dict[str, Any]]) -> str:
    """One line for the plot: the methods timed, and what was not (the Triton kernels
    without a GPU; a method asked for that gave no figure)."""
    from hisparse_triton.benchmarks.settings import GRAPH_METHOD, METHODS

    order = list(METHOD_LABELS)
    timed = sorted({f["method"] for f in figs}, key=order.index)
    asked = list(result.get("settings", {}).get("methods", METHODS))
    if "triton" in asked and result.get("settings", {}).get("graph", True):
        asked.append(GRAPH_METHOD)
    missing = sorted((m for m in asked if m not in timed), key=order.index)
    text = f"timed: {', '.join(timed)}"
    if missing:
        why = (" (no GPU: kernel timings need CUDA)" if not result.get("kernel_timings")
               and any(m.startswith("triton") for m in missing) else "")
        text += f"; NOT timed: {', '.join(missing)}{why}"
    return text


def write_plot(result: dict[str, Any], path: str) -> None:
    """PNG of GB/s vs rows moved (log-log), one panel per (op, row size), one line per method
    and layer count; the kernel methods at the largest miss ratio of the run, built-in launch
    configs (tuned ones as their own, lighter line). The title says what was and was not
    timed; figures judged not results (``benchmarks.noise``) are hollow markers; one legend
    under the panels explains the methods and line styles."""
    plt = pyplot()
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    figs = [f for f in result.get("transfers", []) if f.get("gbps") is not None]
    if not figs:
        raise ValueError("--plot needs transfer figures, and this run measured none.")
    ops_ = sorted({f["op"] for f in figs}, key=TRANSFER_OPS.index)
    sizes = sorted({f["row_bytes"] for f in figs})
    width = max(4.6 * len(sizes), 8.0)
    # The height is set below, once the legend's entries are known.
    fig, axes = plt.subplots(len(ops_), len(sizes), figsize=(width, 3.2 * len(ops_) + 1.5),
                             squeeze=False)
    env = result.get("environment", {})
    kernel_methods = KERNEL_METHODS + ("triton_graph",)
    ratios = sorted({f["miss_ratio"] for f in figs if f.get("miss_ratio") is not None})
    where = env.get("gpu") or f"CPU ({env.get('cpu') or 'unknown'})"
    title = (f"hisparse-triton bench on {where} (torch {env.get('torch')}, triton "
             f"{env.get('triton')}): GB/s of payload per launch against rows moved. "
             f"{what_was_timed(result, figs)}."
             + (f" Kernel methods at miss ratio {max(ratios):g} (the valid share of each "
                f"plan row)." if ratios else ""))
    untrusted = 0
    used: set[tuple[str, int]] = set()
    for i, op in enumerate(ops_):
        for j, size in enumerate(sizes):
            ax = axes[i][j]
            mine = [f for f in figs if f["op"] == op and f["row_bytes"] == size]
            top_ratio = max((f["miss_ratio"] for f in mine if f.get("miss_ratio") is not None),
                            default=None)
            few_points = len({f["rows"] for f in mine}) == 1   # no line: label the values
            lines: dict[tuple[str, int], list[dict[str, Any]]] = {}
            for f in mine:
                if f["method"] in kernel_methods and f.get("miss_ratio") != top_ratio:
                    continue
                label = f["method"] + (" tuned" if f.get("launch_config") == "tuned" else "")
                lines.setdefault((label, f["layers"]), []).append(f)
            for (label, layers), pts in sorted(lines.items()):
                pts.sort(key=lambda f: f["rows"])
                method = label.split()[0]
                color = METHOD_COLORS.get(method)
                alpha = 0.5 if label.endswith("tuned") else 1.0
                style = LAYER_STYLES.get(layers, ":")
                ax.plot([f["rows"] for f in pts], [f["gbps"] for f in pts], color=color,
                        linestyle=style, alpha=alpha)
                for f in pts:
                    bad = f.get("trusted") is False
                    untrusted += bad
                    ax.plot([f["rows"]], [f["gbps"]], marker="o", color=color, alpha=alpha,
                            markerfacecolor="none" if bad else color, markersize=6)
                    if few_points:   # alternate sides so that close values stay legible
                        right = list(METHOD_LABELS).index(method) % 2 == 0
                        ax.annotate(f"{f['gbps']:.3g}", (f["rows"], f["gbps"]), fontsize=7,
                                    xytext=(6 if right else -6, -3), color=color,
                                    textcoords="offset points", ha="left" if right else "right")
                used.add((method, layers))
            rows = sorted({f["rows"] for f in mine})
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xticks(rows)
            ax.xaxis.set_major_formatter(FuncFormatter(count_label))
            ax.xaxis.set_minor_formatter(NullFormatter())
            ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
            ax.yaxis.set_major_formatter(FuncFormatter(plain_label))
            ax.yaxis.set_minor_formatter(NullFormatter())
            ax.set_xlim(rows[0] / 1.6, rows[-1] * 1.6)
            ax.set_title(f"{op}, {size} B rows", fontsize=10)
            ax.set_xlabel("rows moved per launch (per layer)")
            ax.set_ylabel("GB/s (log scale)")
            ax.grid(True, which="major", alpha=0.3)
    methods = sorted({m for m, _ in used}, key=list(METHOD_LABELS).index)
    handles = [Line2D([], [], color=METHOD_COLORS[m], marker="o", label=METHOD_LABELS[m])
               for m in methods]
    handles += [Line2D([], [], color="black", linestyle=LAYER_STYLES.get(n, ":"),
                       label=f"{n} layer{'s' if n != 1 else ''} per launch")
                for n in sorted({n for _, n in used})]
    if any(f.get("launch_config") == "tuned" for f in figs):
        handles.append(Line2D([], [], color="tab:red", alpha=0.5, label="lighter: a tuned "
                                                                         "launch config"))
    if untrusted:
        handles.append(Line2D([], [], color="black", marker="o", markerfacecolor="none",
                              linestyle="none", label="hollow: NOT a result (measured under "
                                                      "noise; see the table's note)"))
    legend_in = 0.2 * len(handles) + 0.3
    height = 3.2 * len(ops_) + legend_in
    fig.set_size_inches(width, height)
    top = _title(fig, title, width)
    bottom = legend_in / height
    fig.legend(handles=handles, loc="lower left", ncol=1, fontsize=8, frameon=False,
               bbox_to_anchor=(0.02, 0.0))
    fig.tight_layout(rect=(0, bottom, 1, top))
    fig.savefig(path, format="png", dpi=110)
    plt.close(fig)


def write_advise_plot(payload: dict[str, Any], path: str) -> None:
    """PNG of an ``advise`` sweep against the hot-buffer size, one line per block size: miss
    rate, GPU memory per request (in the unit that fits, as the table), steady-state
    concurrency and the throughput estimate; the all-GPU level dashed, the recommendation a
    star, one legend under the panels."""
    plt = pyplot()
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FuncFormatter, NullFormatter

    from hisparse_triton.units import byte_unit

    rows = [r for r in payload["settings"] if "error" not in r]
    if not rows:
        raise ValueError("--plot: no setting of the sweep fits the budget.")
    gpu = payload.get("all_gpu") or {}
    unit_name, unit = byte_unit([r["gpu_bytes_per_request"] for r in rows]
                                + ([gpu["gpu_bytes_per_request"]] if gpu else []))
    panels = (("miss_rate", "miss rate (%)", 100.0),
              ("gpu_bytes_per_request", f"GPU memory per request ({unit_name})", 1 / unit),
              ("concurrency", "steady-state requests", 1.0),
              ("tokens_per_s", "decode tokens/s (advise's estimate)", 1.0))
    width = 4.0 * len(panels)
    fig, axes = plt.subplots(1, len(panels), figsize=(width, 4.3), squeeze=False)
    top = _title(fig, f"hisparse-triton advise: {payload['preset']}, "
                      f"{payload['context_len']} tokens/request, "
                      f"{payload['gpu_memory_gib']:g} GiB GPU, {payload['host_pool_gib']:g} "
                      f"GiB host (estimates of advise's model: miss rates replayed, the rest "
                      f"computed)", width)
    best = payload.get("recommended") or {}
    buffers = sorted({r["device_buffer_size"] for r in rows})
    blocks = sorted({r["block_size"] for r in rows})
    colors = {block: f"C{i}" for i, block in enumerate(blocks)}
    for ax, (key, title, scale) in zip(axes[0], panels):
        for block in blocks:
            pts = sorted((r["device_buffer_size"], r[key] * scale) for r in rows
                         if r["block_size"] == block)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", color=colors[block])
        if key in ("concurrency", "tokens_per_s", "gpu_bytes_per_request") and gpu:
            ax.axhline(gpu[key] * scale, color="tab:gray", linestyle="--")
        if best.get("mode", "hisparse") == "hisparse" and best.get("block_size"):
            mine = next(r for r in rows if r["block_size"] == best["block_size"]
                        and r["device_buffer_size"] == best["device_buffer_size"])
            ax.plot([mine["device_buffer_size"]], [mine[key] * scale], marker="*",
                    markersize=14, color="tab:red", linestyle="none")
        ax.set_xscale("log", base=2)
        ax.set_xticks(buffers)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _p: f"{v:g}"))
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("device_buffer_size (rows)")
        ax.set_title(title, fontsize=9)
        ax.grid(True, alpha=0.3)
    handles = [Line2D([], [], color=colors[b], marker="o", label=f"block size {b}")
               for b in blocks]
    if gpu:
        handles.append(Line2D([], [], color="tab:gray", linestyle="--",
                              label="all-GPU: every layer on the GPU, no HiSparse"
                                    + (" (recommended)" if best.get("mode") == "all-gpu"
                                       else "")))
    if best.get("mode", "hisparse") == "hisparse" and best.get("block_size"):
        handles.append(Line2D([], [], color="tab:red", marker="*", markersize=12,
                              linestyle="none", label="recommended setting"))
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8,
               frameon=False)
    fig.tight_layout(rect=(0, 0.08, 1, top))
    fig.savefig(path, format="png", dpi=110)
    plt.close(fig)
