"""``resolve`` benchmarks (the decode shape of DeepSeek-V3.2: 64 requests x top-k 2048 x 4096
hot slots), on the measurement library ``hisparse_triton.benchmarks`` (the workload and
checks of ``hisparse-triton bench``).

    python -m pytest bench/bench_resolve.py             # CPU: pytest-benchmark + host cost
    python -m pytest bench/bench_resolve.py -k gpu      # GPU: the library's figures

Every call starts from the same warm state (``ResolveWorkload``: full hot buffers, the LRU
order of real use, restored before each call, untimed) with a prescribed miss ratio, so the
figures do not drift as the state would under repeated calls. Calls use the decode form of
the API: a reusable ``ResolveWorkspace``, a caller-owned ``out`` for the rows and device-side
``counters`` (on Triton: the hash resolve and its fallback launch).

CPU: the torch reference (the runtime's CPU backend) at batch 1 / 8 / 64, miss ratio 0.067
(buffer = 4k in the GLM-5.1 trace) and 1 (cold); the host cost of one ``ops.resolve`` +
``ops.copy_rows`` with the launches stubbed out. GPU: the Triton kernel per call and replayed
from a CUDA graph, and the torch reference on the GPU, at batch 64 and the three miss ratios
of the GLM-5.1 trace, each checked bit for bit against the reference.
"""

from __future__ import annotations

import sys

import pytest
import torch

from hisparse_triton import benchmarks as bm
from hisparse_triton import ops
from hisparse_triton.ops.resolve import reference
from lab.host_cost import resolve_host_cost
from hisparse_triton.benchmarks.timing import L2Flush

TOP_K, HOT, SEQ = 2048, 4096, 32768
HAS_CUDA = torch.cuda.is_available()


def decode_call(work: bm.ResolveWorkload, backend: str):
    """``ops.resolve`` of the workload's step as the runtime calls it: workspace, ``out`` and
    counters allocated once, outside the timed call."""
    dev = work.topk.device
    keywords = dict(workspace=ops.ResolveWorkspace(dev),
                    out=torch.empty(work.batch, work.top_k, dtype=torch.int32, device=dev),
                    counters=torch.zeros(3, dtype=torch.int64, device=dev))
    return lambda: ops.resolve(*work.args(), **work.kwargs, **keywords, backend=backend)


@pytest.mark.parametrize("batch, ratio", [(1, 0.067), (8, 0.067), (64, 0.067), (64, 1.0)])
def test_cpu_reference_resolve(benchmark, record, batch, ratio):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        work = bm.ResolveWorkload(batch, TOP_K, HOT, SEQ, ratio, torch.device("cpu"))
        out = benchmark.pedantic(decode_call(work, "torch"), setup=work.restore,
                                 rounds=max(3, 24 // batch), warmup_rounds=1)
    finally:
        torch.set_num_threads(threads)
    misses = int(out.stats[:, 1].sum())
    assert misses == round(work.expected_miss_ratio * batch * TOP_K)
    if benchmark.stats is None:  # --benchmark-disable: ran once, nothing timed
        return
    record({"op": "resolve", "method": "torch", "batch": batch, "top_k": TOP_K,
            "hot_slots": HOT, "seq_len": SEQ, "miss_ratio": ratio,
            "measured_miss_ratio": misses / (batch * TOP_K),
            "time_us": round(benchmark.stats.stats.median * 1e6, 1)}, "cpu")


def test_cpu_host_cost():
    """Host time of the decode call of one index group with the launches stubbed out; the
    launch count is the budget's (the hash resolve with its counters, its fallback launch,
    then the gather)."""
    cost = resolve_host_cost(batch=64, top_k=TOP_K, hot_slots=HOT)
    print(f"\nhost cost of ops.resolve + ops.copy_rows (launches stubbed): {cost}")
    assert cost["launches_per_call"] == 3 and cost["api"] == "workspace"


@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("ratio", bm.DEFAULT_MISS_RATIOS)
def test_gpu_resolve(record, ratio):
    device = torch.device("cuda")
    l2 = torch.cuda.get_device_properties(device).L2_cache_size
    flush = L2Flush(device, max(2 * l2, 64 << 20))
    work = bm.ResolveWorkload(64, TOP_K, HOT, SEQ, ratio, device)
    work.restore()
    want = [t.clone() for t in reference.resolve(*work.args(), **work.kwargs)]
    want_state = (work.slot_host_rows.clone(), work.lru.clone())
    params = {"op": "resolve", "batch": 64, "top_k": TOP_K, "hot_slots": HOT, "seq_len": SEQ,
              "miss_ratio": ratio}
    calls = {"triton": decode_call(work, "triton"), "torch": decode_call(work, "torch")}
    work.restore()
    graph, graph_out = bm.capture_graph(calls["triton"])
    calls["triton_graph"] = lambda: (graph.replay(), graph_out)[1]
    times = {}
    for method, call in calls.items():
        work.restore()
        got = call()
        torch.cuda.synchronize()
        ok = all(torch.equal(g, w) for g, w in zip(got, want)) \
            and torch.equal(work.slot_host_rows, want_state[0]) \
            and torch.equal(work.lru, want_state[1])
        assert ok, f"{method}: outputs or state differ from the torch reference"
        timing = bm.event_time(call, work.restore, flush, warmup_ms=25, rep_ms=100)
        times[method] = timing.median_ms * 1e3
        record({**params, "method": method, "measured_miss_ratio":
                int(got.stats[:, 1].sum()) / (64 * TOP_K), "time_us": round(times[method], 1),
                "verified": True}, "cuda")
    print(f"\nresolve 64 x {TOP_K} x {HOT}, miss ratio {ratio}: "
          + ", ".join(f"{m} {t:.1f} us" for m, t in times.items()))


# ------------------------------------------------------------------ the SASS model (no GPU)


def model_summary(widths=(2048, 4096, 8192, 16384, 32768), arch: int = 90,
                  progress=None) -> dict:
    """The compile report's issue-cycle model (``hisparse_triton/compile/sass_model.py``) of every resolve
    variant at the top-k ``widths``: per variant the kernel, warps, registers, CTAs per SM and
    the model (cycles per row, us per call at R = 1, 8, 64, 132). Compiles for ``sm_<arch>``
    on CPU (tens of seconds; more for the wide variants on a cold Triton cache); needs
    ``TRITON_INTERPRET`` unset. ``progress(what)`` is called before each compile."""
    from hisparse_triton.compile.report import compile_report

    payload = compile_report(arch, groups=("resolve",), widths=widths, small_host=True,
                             progress=progress)
    keep = ("variant", "kernel", "grid", "num_warps", "registers", "spills", "shared_bytes",
            "sass_instructions", "ctas_per_sm", "error", "model")
    return {"schema": "hisparse-triton/resolve-model", "schema_version": 2,
            "arch": payload["arch"], "triton": payload["triton"],
            "variants": [{k: r.get(k) for k in keep} for r in payload["launches"]],
            "per_call": per_call(payload["launches"])}


def per_call(launches: list) -> dict:
    """Per resolve call (one index group; the report's records of one call share ``call``):
    the model's us of every launch the call makes at its own grid, summed (the hash resolve:
    its hash launch and its fallback launch, each costed on the path it takes in a batch
    without a flagged row; ``if_a_row_is_flagged_us``: the sum when one row of the batch
    falls back). Launch latency is not included."""
    calls: dict = {}
    for r in launches:
        model = r.get("model")
        if not model:
            continue
        entry = calls.setdefault(r["call"], {"launches": [], "us": 0.0,
                                        "if_a_row_is_flagged_us": 0.0})
        us = model["us_per_call_this_grid"]
        flagged = model.get("if_a_row_takes_the_full_path")
        entry["launches"].append({"kernel": r["kernel"], "us": us, "path": model.get("path")})
        entry["us"] = round(entry["us"] + us, 2)
        full = us if flagged is None else flagged["us_per_call_this_grid"]
        entry["if_a_row_is_flagged_us"] = round(entry["if_a_row_is_flagged_us"] + full, 2)
    return calls


def main(argv: list[str]) -> int:
    """``python bench/bench_resolve.py OUT.json [widths,...]``: the SASS model of every resolve
    variant to ``OUT.json``, one progress line per compile on stderr."""
    import json
    import time

    if not argv or argv[0].startswith("-"):
        print("usage: python bench/bench_resolve.py OUT.json [WIDTH,...]  (the SASS model of "
              "every resolve variant; default widths 2048,4096,8192,16384,32768)",
              file=sys.stderr)
        return 2
    out = argv[0]
    widths = tuple(int(w) for w in argv[1].split(",")) if len(argv) > 1 else \
        (2048, 4096, 8192, 16384, 32768)
    started = time.perf_counter()
    count = [0]

    def progress(what: str) -> None:
        count[0] += 1
        print(f"bench_resolve: [{time.perf_counter() - started:5.1f} s] compiling launch "
              f"{count[0]}: {what}", file=sys.stderr, flush=True)

    print(f"bench_resolve: compiling every resolve variant at top-k {', '.join(map(str, widths))}"
          f" for sm_90 (tens of seconds on a CPU), then writing {out}", file=sys.stderr,
          flush=True)
    summary = model_summary(widths, progress=progress)
    with open(out, "w") as f:
        json.dump(summary, f, indent=1)
        f.write("\n")
    print(f"wrote {out}: {len(summary['variants'])} variants in "
          f"{time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":  # python bench/bench_resolve.py OUT.json [widths,...]
    sys.exit(main(sys.argv[1:]))
