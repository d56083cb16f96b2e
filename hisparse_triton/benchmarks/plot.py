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
    return max(0.5, 1.0 - (0.22 * len(lines) + 0.1) / height_in)


def write_plot(result: dict[str, Any], path: str) -> None:
    """PNG of GB/s vs rows moved (log-log), one panel per (op, row size), one line per method
    and layer count; the kernel methods at the largest miss ratio of the run, built-in launch
    configs (tuned ones as their own line)."""
    plt = pyplot()
    figs = [f for f in result.get("transfers", []) if f.get("gbps") is not None]
    if not figs:
        raise ValueError("--plot needs transfer figures, and this run measured none.")
    ops_ = sorted({f["op"] for f in figs}, key=TRANSFER_OPS.index)
    sizes = sorted({f["row_bytes"] for f in figs})
    width = 4.2 * len(sizes)
    fig, axes = plt.subplots(len(ops_), len(sizes), figsize=(width, 3.2 * len(ops_)),
                             squeeze=False)
    env = result.get("environment", {})
    top = _title(fig, f"hisparse-triton bench: {env.get('gpu') or 'CPU'} (torch "
                      f"{env.get('torch')}, triton {env.get('triton')})", width)
    styles = {1: "-", 2: "--", 4: "-."}
    colors = {"triton": "tab:red", "triton_graph": "tab:orange", "torch": "tab:blue",
              "eager": "tab:gray", "contiguous": "tab:green"}
    kernel_methods = KERNEL_METHODS + ("triton_graph",)
    for i, op in enumerate(ops_):
        for j, size in enumerate(sizes):
            ax = axes[i][j]
            mine = [f for f in figs if f["op"] == op and f["row_bytes"] == size]
            top_ratio = max((f["miss_ratio"] for f in mine if f.get("miss_ratio") is not None),
                            default=None)
            lines: dict[tuple[str, int], list[tuple[int, float]]] = {}
            for f in mine:
                if f["method"] in kernel_methods and f.get("miss_ratio") != top_ratio:
                    continue
                label = f["method"] + (" tuned" if f.get("launch_config") == "tuned" else "")
                lines.setdefault((label, f["layers"]), []).append((f["rows"], f["gbps"]))
            for (label, layers), pts in sorted(lines.items()):
                pts.sort()
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                        color=colors.get(label.split()[0]), linestyle=styles.get(layers, ":"),
                        alpha=0.6 if label.endswith("tuned") else 1.0,
                        label=f"{label} L={layers}")
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_title(f"{op}, {size} B rows", fontsize=9)
            ax.set_xlabel("rows moved")
            ax.set_ylabel("GB/s (log)")
            ax.grid(True, alpha=0.3)
            ax.legend(fontsize=6)
    fig.tight_layout(rect=(0, 0, 1, top))
    fig.savefig(path, format="png", dpi=110)
    plt.close(fig)


def write_advise_plot(payload: dict[str, Any], path: str) -> None:
    """PNG of an ``advise`` sweep against the hot-buffer size, one line per block size: miss
    rate, GPU memory per request, steady-state concurrency and the throughput estimate."""
    plt = pyplot()
    rows = [r for r in payload["settings"] if "error" not in r]
    if not rows:
        raise ValueError("--plot: no setting of the sweep fits the budget.")
    panels = (("miss_rate", "miss rate", 100.0, "%"),
              ("gpu_bytes_per_request", "GPU memory / request", 1 / 2**20, "MiB"),
              ("concurrency", "steady-state requests", 1.0, ""),
              ("tokens_per_s", "decode tokens/s (estimate)", 1.0, ""))
    width = 4.0 * len(panels)
    fig, axes = plt.subplots(1, len(panels), figsize=(width, 3.6), squeeze=False)
    top = _title(fig, f"hisparse-triton advise: {payload['preset']}, "
                      f"{payload['context_len']} tokens/request, "
                      f"{payload['gpu_memory_gib']:g} GiB GPU, {payload['host_pool_gib']:g} "
                      f"GiB host", width)
    best = payload.get("recommended") or {}
    gpu = payload.get("all_gpu") or {}
    for ax, (key, title, scale, unit) in zip(axes[0], panels):
        for block in sorted({r["block_size"] for r in rows}):
            pts = sorted((r["device_buffer_size"], r[key] * scale) for r in rows
                         if r["block_size"] == block)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                    label=f"block {block}")
        if key in ("concurrency", "tokens_per_s", "gpu_bytes_per_request") and gpu:
            ax.axhline(gpu[key] * scale, color="tab:gray", linestyle="--",
                       label="all-GPU" + (" (recommended)" if best.get("mode") == "all-gpu"
                                          else ""))
        if best.get("mode", "hisparse") == "hisparse" and best.get("block_size"):
            mine = next(r for r in rows if r["block_size"] == best["block_size"]
                        and r["device_buffer_size"] == best["device_buffer_size"])
            ax.plot([mine["device_buffer_size"]], [mine[key] * scale], marker="*",
                    markersize=14, color="tab:red", linestyle="none", label="recommended")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("device_buffer_size (rows)")
        ax.set_title(title + (f" ({unit})" if unit else ""), fontsize=9)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=6)
    fig.tight_layout(rect=(0, 0, 1, top))
    fig.savefig(path, format="png", dpi=110)
    plt.close(fig)
