#!/usr/bin/env python3
"""One prepared GPU check: the performance-target measurements, ``tune`` for 656 B rows and
the test suite on CUDA, in priority order inside one time budget, written as ONE JSON file
(plus logs) under ``$OUT``. Ops are named by the op registry's groups (``--ops rows``,
``--ops pages``, ``--kernel rows``: ``hisparse_triton.benchmarks.registry``), so a new op of a
group joins its steps without an edit here.

Usage on a GPU machine, from the repository root::

    OUT=/some/dir python3 bench/gpu_check.py            # under 6 minutes (--budget-s 330)
    OUT=/some/dir python3 bench/gpu_check.py --quick    # a shorter rerun (--budget-s 240)
    OUT=/some/dir python3 bench/gpu_check.py --only tests,tune   # some steps only

and on any machine, to check the script itself (torch paths only, CPU)::

    OUT=/tmp/x python3 bench/gpu_check.py --dry-run

Steps (``STEPS``; each a subprocess with its own time limit, cut to what is left of the
budget; at its limit a step gets SIGINT and ``bench`` / ``tune`` keep what they measured; a
step that cannot start inside the budget is recorded as skipped):

0. make ``hisparse_triton.kernels`` importable (``pip install --no-deps --no-build-isolation
   --no-index -e .`` when it is not: offline, setuptools only); ``device_info()`` records
   the devices (SM / CU counts);
1. ``decode-checks``: issue 20's decode-path points in one subprocess
   (``lab.decode_checks``): host time per eager launch (bound vs checked), resolve
   variants, our hash and sorted resolves against vLLM's compiled one on the same inputs
   (``lab.resolve_compare``, when vLLM's build is importable), a step with and without the
   side-stream overlap (grid capped vs not), the split gather against the plain gather on
   the same miss plans (``lab.split_bench``: one GPU, and every GPU when there are 2+, else
   that run skipped with the reason), the vLLM ops; each section records its own error and
   is saved as soon as it is done;
   ``decode-step``: a whole DeepSeek-V3.2 decode step at batch 64 through the runtime (61
   index groups, every request on the host path): the eager step and the graph-replayed
   step (the decode forward from one CUDA graph, a new plan each step), device and host time
   of each, the 61 resolves alone from the graph, misses and GB/s gathered per step (its
   overlap runs left out: decode-checks has them);
2. ``bench-targets``: 656 B gather / backup at 4k, 32k, 256k rows, 1 and 4 layers, miss
   ratios 1, 0.3, 0.067: Triton (per launch and CUDA-graph replay) vs torch eager vs the
   contiguous pinned copy, all in one run;
3. ``tests``: ``pytest tests`` on CUDA (pytest-xdist workers when installed: the first
   Triton compile of each kernel specialisation costs about 1-3 s, in parallel there);
   ``bench-resolve``: resolve at 64 x 2048 x 4096, miss ratios 1, 0.3, 0.067 (Triton, graph
   replay, torch reference);
4. ``tune``: 656 B rows, gather and backup, 1 and 4 layers (``--quick`` grid), into
   ``$OUT/tuning-cache.json`` (the user's cache is not touched);
   ``sglang-swap-in`` (not in ``--quick``; alone: ``--only sglang-swap-in``): SGLang 0.5.23's
   swap-in in SGLang's layout (``hisparse_triton.benchmarks.sglang_swap_in``) at 64 x 2048 x
   4096, 656 B rows, miss ratios 0.134 and 1: ours (swap-in, resolve alone, CUDA-graph replay,
   follower replay) against SGLang's JIT kernel when SGLang is importable and its JIT builds
   (else skipped with the reason), and whether the two agree bit for bit;
5. ``bench-tuned``: step 2's gather / backup figures again with the tuned cache;
6. the rest of the sweep while the budget lasts: 656 B page copies, 656 B small transfers
   (the torch backend too), resolve at other batch sizes, 132 and 1152 B rows.

Output (at most 5 files, inside the device tool's limits): ``$OUT/<gpu>-<YYYY-MM-DD>.json``
(commit it as ``bench/results/<gpu>-<YYYY-MM-DD>.json``) with the environment (GPU name,
driver, clocks, torch, triton, CUDA), every step's exit code, time, output tail and summary,
the merged bench result, the tune result and where each performance target stands;
``bench.png`` (when matplotlib is there), ``logs.txt`` (every step's full output) and
``tuning-cache.json``. The JSON is rewritten after every step, and a running bench step
checkpoints its own ``<step>.json`` after every case, so a run killed from outside still
returns what it measured. The last lines printed are a compact summary of the targets.
"""

from __future__ import annotations

import argparse
import atexit
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import date
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = "hisparse-triton/gpu-check"
VERSION = 2
#: Seconds a step may take to write its partial results after SIGINT at its time limit.
GRACE_S = 10
#: A step is not started with less than this many seconds of budget left.
MIN_STEP_S = 15

TARGET_ROWS = ["--row-bytes", "656", "--rows", "4k,32k,256k", "--layers", "1,4"]


@dataclass(frozen=True)
class Step:
    """One step of the plan: ``kind`` ``bench`` / ``tune`` / ``tests``, its flags, its time
    limit (s), and the flags / limit used with ``--quick`` (``None``: not run then)."""

    name: str
    kind: str
    flags: tuple[str, ...]
    limit_s: float
    quick_flags: Optional[tuple[str, ...]] = None
    quick_limit_s: float = 0
    env: dict[str, str] = field(default_factory=dict)


STEPS = (
    Step("decode-checks", "decode-checks", (), 85, ("--quick",), 50),
    Step("decode-step", "decode", ("--decode-step", "--no-overlap"), 45,
         ("--decode-step", "--quick", "--no-overlap"), 30),
    Step("bench-targets", "bench",
         (*TARGET_ROWS, "--ops", "rows", "--methods", "triton,eager,contiguous",
          "--miss-ratios", "1,0.3,0.067"), 80,
         ("--row-bytes", "656", "--rows", "4k,64k", "--layers", "1,4", "--ops",
          "rows", "--methods", "triton,eager,contiguous", "--miss-ratios", "1,0.067",
          "--rep-ms", "25"), 40),
    Step("tests", "tests", ("tests",), 150,
         ("tests/test_gather_kernel.py", "tests/test_backup_kernel.py",
          "tests/test_resolve_kernel.py", "tests/test_ops.py", "tests/test_cli_bench.py",
          "tests/test_cuda_graph.py", "tests/test_launch_budget.py",
          "tests/test_side_stream.py"), 60),
    Step("bench-resolve", "bench",
         ("--ops", "resolve", "--batch", "64", "--top-k", "2048", "--hot-slots", "4096",
          "--seq-len", "32768", "--miss-ratios", "1,0.3,0.067", "--methods", "triton,torch"),
         75,
         ("--ops", "resolve", "--batch", "64", "--top-k", "2048", "--hot-slots", "4096",
          "--seq-len", "32768", "--miss-ratios", "1,0.067", "--methods", "triton,torch"), 30),
    Step("tune", "tune",
         ("--row-bytes", "656", "--kernel", "rows", "--layers", "1,4", "--quick"), 110,
         ("--row-bytes", "656", "--kernel", "rows", "--layers", "1", "--quick"), 30),
    Step("sglang-swap-in", "sglang", ("--miss-ratios", "0.134,1"), 60),
    Step("bench-tuned", "bench",
         (*TARGET_ROWS, "--ops", "rows", "--methods", "triton,contiguous",
          "--miss-ratios", "1,0.067"), 60),
    Step("bench-pages", "bench",
         (*TARGET_ROWS, "--ops", "pages", "--methods", "triton,eager,contiguous"), 60),
    Step("bench-small", "bench",
         ("--row-bytes", "656", "--rows", "512,2k", "--layers", "1,4", "--ops",
          "rows", "--methods", "triton,torch,eager,contiguous", "--miss-ratios",
          "1,0.067"), 45),
    Step("bench-resolve-batches", "bench",
         ("--ops", "resolve", "--batch", "1,4,16,256", "--miss-ratios", "1,0.067",
          "--methods", "triton,torch"), 60),
    Step("bench-row-sizes", "bench",
         ("--row-bytes", "132,1152", "--rows", "4k,32k,256k", "--layers", "1,4", "--ops",
          "rows", "--methods", "triton,eager,contiguous", "--miss-ratios", "1,0.067"),
         60),
)
#: ``--dry-run`` (CPU): tiny versions of a bench step, tune and a test file.
DRY_RUN_FLAGS = {
    "bench": ("--quick", "--device", "cpu", "--ops", "gather,resolve", "--layers", "1"),
    "tune": ("--dry-run", "--row-bytes", "656", "--kernel", "gather", "--layers", "1",
             "--quick"),
    "tests": ("tests/test_tuning_cache.py",),
    "decode-checks": ("--quick", "--device", "cpu"),
}
DRY_RUN_STEPS = ("decode-checks", "bench-targets", "tune", "tests")


def _run(cmd: list[str], log: Path, timeout: float, env: Optional[dict[str, str]] = None
         ) -> dict[str, Any]:
    """Run ``cmd`` in the repository root, appending its output to ``log``; a summary dict
    (``rc`` None when it ran past ``timeout`` seconds and did not stop after SIGINT)."""
    start = time.time()
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    rc: Optional[int] = None
    timed_out = False
    with open(log, "a", encoding="utf-8") as handle:
        handle.write("\n$ " + " ".join(cmd) + "\n")
        handle.flush()
        begin = handle.tell()
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=handle, stderr=subprocess.STDOUT,
                                env=full_env)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            timed_out = True  # SIGINT first: bench and tune write what they have; then kill
            proc.send_signal(signal.SIGINT)
            try:
                rc = proc.wait(timeout=GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    with open(log, encoding="utf-8", errors="replace") as handle:
        handle.seek(begin)
        text = handle.read()
    return {"cmd": cmd, "rc": rc, "timed_out": timed_out,
            "wall_s": round(time.time() - start, 1), "tail": text[-3000:]}


def pytest_summary(text: str) -> dict[str, Any]:
    """Counts from pytest's last summary line (``3 passed, 1 skipped in 2.0s``) and the
    ``FAILED`` / ``ERROR`` test ids."""
    counts: dict[str, Any] = {}
    lines = [l for l in text.splitlines() if re.search(r"\d+ (passed|failed|errors?)\b", l)]
    if lines:
        for n, what in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|"
                                  r"deselected|warnings?)", lines[-1]):
            counts[what.rstrip("s") if what.startswith(("error", "warning")) else what] = int(n)
    failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", text, flags=re.MULTILINE)
    if failed:
        counts["failed_tests"] = failed[:50]
    return counts


def _load_json(path: Path) -> Optional[Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None


def _importable() -> bool:
    probe = [sys.executable, "-c", "import hisparse_triton.kernels, hisparse_triton.cli"]
    return subprocess.run(probe, cwd=ROOT, capture_output=True).returncode == 0


def ensure_installed(log: Path) -> dict[str, Any]:
    """Make ``hisparse_triton`` (with ``hisparse_triton.kernels``) importable from the repo:
    already, or by an offline editable install, or (last resort, for this run only) a
    ``hisparse_triton/kernels`` link to ``kernels/`` removed at exit."""
    if _importable():
        return {"rc": 0, "note": "already importable"}
    step = _run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                 "--no-build-isolation", "--no-index", "-e", str(ROOT)], log, timeout=120)
    if step["rc"] == 0 and _importable():
        return step
    link = ROOT / "hisparse_triton" / "kernels"
    if not link.exists():
        link.symlink_to(Path("..") / "kernels", target_is_directory=True)
        atexit.register(lambda: link.unlink() if link.is_symlink() else None)
    step["fallback"] = "pip failed: linked hisparse_triton/kernels -> ../kernels for this run"
    step["rc"] = 0 if _importable() else step["rc"]
    return step


def _has(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def tests_command(paths: tuple[str, ...], cuda: bool) -> list[str]:
    """``pytest`` on ``paths``: xdist workers (CUDA) and a per-test timeout when installed."""
    cmd = [sys.executable, "-m", "pytest", *paths, "-q", "-p", "no:cacheprovider", "-rfE",
           "--durations=15"]
    if cuda and _has("xdist"):
        cmd += ["-n", str(max(1, min(8, (os.cpu_count() or 2) // 2)))]
    if _has("pytest_timeout"):
        cmd += ["--timeout=120"]
    return cmd


def _fill_eager_ratios(transfers: list[dict[str, Any]]) -> None:
    """A figure without ``vs_eager`` (its step timed no eager baseline) gets it from an eager
    figure of the same op and size measured by another step of this check."""
    eager = {(f.get("op"), f.get("row_bytes"), f.get("rows"), f.get("layers")): f
             for f in transfers if f.get("method") == "eager" and f.get("gbps")}
    for f in transfers:
        key = (f.get("op"), f.get("row_bytes"), f.get("rows"), f.get("layers"))
        if f.get("gbps") and "vs_eager" not in f and key in eager:
            f["vs_eager"] = float(f"{f['gbps'] / eager[key]['gbps']:.4g}")
            f["vs_eager_from"] = eager[key].get("step", "another step")


def merge_bench(results: list[tuple[str, Optional[dict[str, Any]]]]) -> Optional[dict[str, Any]]:
    """One bench result from the steps' results (each figure tagged with its ``step``;
    targets re-evaluated on the union)."""
    from hisparse_triton.benchmarks.targets import evaluate_targets

    results = [(name, r) for name, r in results if r]
    if not results:
        return None
    merged = {k: v for k, v in results[0][1].items() if k not in ("settings", "targets")}
    merged["transfers"] = [{**f, "step": name} for name, r in results
                           for f in r.get("transfers", [])]
    merged["resolve"] = [{**f, "step": name} for name, r in results
                         for f in r.get("resolve", [])]
    _fill_eager_ratios(merged["transfers"])
    merged["wall_s"] = round(sum(r.get("wall_s", 0) for _, r in results), 1)
    merged["kernel_timings"] = any(r.get("kernel_timings") for _, r in results)
    merged["interrupted"] = any(r.get("interrupted") or not r.get("finished", True)
                                for _, r in results)
    merged["notes"] = sorted({n for _, r in results for n in r.get("notes", [])})
    merged["steps"] = {name: r.get("settings") for name, r in results}
    merged["targets"] = evaluate_targets(merged)
    return merged


def _ceilings(bench: dict[str, Any]) -> list[str]:
    """The contiguous pinned copies measured (the link ceiling), per direction."""
    from hisparse_triton.benchmarks.registry import DIRECTION, ROW_OPS

    lines = []
    for op, label in ((op, DIRECTION[op].upper()) for op in ROW_OPS):
        figs = [f for f in bench.get("transfers", [])
                if f.get("method") == "contiguous" and f.get("op") == op and f.get("gbps")]
        if figs:
            lo = min(figs, key=lambda f: f["gbps"])
            hi = max(figs, key=lambda f: f["gbps"])
            lines.append(f"  contiguous pinned copy {label}: {lo['gbps']:.1f} GB/s "
                         f"({lo['bytes'] / 1e6:.1f} MB) .. {hi['gbps']:.1f} GB/s "
                         f"({hi['bytes'] / 1e6:.1f} MB)")
    return lines


def summary_lines(report: dict[str, Any]) -> list[str]:
    """The compact summary printed last: environment, steps, link ceilings, targets."""
    from hisparse_triton.benchmarks.targets import target_lines

    env = report.get("environment", {})
    lines = [f"gpu_check on {env.get('gpu') or 'CPU'}: driver {env.get('driver')}, torch "
             f"{env.get('torch')}, triton {env.get('triton')}, "
             + (f"HIP {env.get('hip_runtime')} ({env.get('gcn_arch')}, {env.get('cu_count')} CUs)"
                if env.get("hip_runtime") else f"CUDA {env.get('cuda_runtime')}")
             + f"; {report.get('wall_s')} s of budget {report.get('budget_s')} s"]
    for name, s in report.get("steps", {}).items():
        state = ("skipped: " + s["skipped"]) if s.get("skipped") else \
            "ok" if s.get("rc") == 0 else "TIMEOUT" if s.get("timed_out") else \
            f"FAILED rc={s.get('rc')}"
        extra = ""
        if name == "tests" and s.get("summary"):
            extra = " " + ", ".join(f"{v} {k}" for k, v in s["summary"].items()
                                    if k != "failed_tests")
        lines.append(f"  {name:<22} {state:<10} {s.get('wall_s', 0):>6} s{extra}")
    for rec in ((report.get("steps", {}).get("tune") or {}).get("result") or {}).get(
            "results", []):
        best, default = rec.get("best") or {}, rec.get("default") or {}
        lines.append(f"  tuned {rec['kernel']} {rec['row_bytes']} B L{rec['num_layers']}: "
                     f"{best.get('gbps')} GB/s vs default {default.get('gbps')} GB/s "
                     f"(x{rec.get('speedup_vs_default')})")
    decode = (report.get("steps", {}).get("decode-step") or {}).get("result") or {}
    if decode.get("eager_step_device_ms") is not None:
        lines.append(f"  decode step ({decode.get('preset')}, batch {decode.get('batch')}): "
                     f"eager {decode['eager_step_device_ms']} ms device / "
                     f"{decode.get('eager_step_host_ms')} ms host; graph-replayed "
                     f"{decode.get('graph_step_device_ms')} ms device / "
                     f"{decode.get('graph_step_host_ms')} ms host; resolves from the graph "
                     f"{decode.get('graph_resolve_us_per_group')} us per index group "
                     f"(target <= 15); {decode.get('h2d_gbps_in_step')} GB/s gathered")
    lines += decode_check_lines(report)
    lines += sglang_lines(report)
    bench = report.get("bench")
    if bench:
        lines += _ceilings(bench)
    if report.get("targets"):
        lines.append("performance targets (ratio >= 1 = met):")
        lines += target_lines(report["targets"])
    return lines


def device_info() -> dict[str, Any]:
    """What the check ran on, per visible device: name, vendor, compute units (SMs / CUs),
    memory, capability; and the device count. Extend here for other vendors' details (ROCm:
    ``torch.version.hip``, gfx arch, CU count)."""
    import torch

    info: dict[str, Any] = {"cuda_available": torch.cuda.is_available(),
                            "hip": getattr(torch.version, "hip", None),
                            "cuda": torch.version.cuda, "devices": []}
    if not torch.cuda.is_available():
        return info
    info["device_count"] = torch.cuda.device_count()
    for index in range(torch.cuda.device_count()):
        p = torch.cuda.get_device_properties(index)
        info["devices"].append({
            "index": index, "name": p.name,
            "vendor": "amd" if info["hip"] else "nvidia",
            "compute_units": p.multi_processor_count,
            "memory_gib": round(p.total_memory / 2**30, 1),
            "capability": f"{p.major}.{p.minor}",
            "arch": getattr(p, "gcnArchName", None) or f"sm_{p.major}{p.minor}"})
    return info


def decode_check_lines(report: dict[str, Any]) -> list[str]:
    """Summary lines of the decode-checks step (issue 20's points)."""
    result = ((report.get("steps", {}).get("decode-checks") or {}).get("result") or {})
    lines = []
    for name, section in (result.get("sections") or {}).items():
        if "error" in section:
            lines.append(f"  decode-checks {name}: ERROR {section['error'][:120]}")
        elif "skipped" in section:
            lines.append(f"  decode-checks {name}: skipped ({section['skipped'][:100]})")
        elif name == "split_gather" and section.get("runs"):
            lines += split_gather_lines(section)
        else:
            figures = {k: v for k, v in section.items()
                       if k not in ("note", "wall_s") and not isinstance(v, (list, str))}
            lines.append(f"  decode-checks {name}: {json.dumps(figures)[:300]}")
    return lines


def split_gather_lines(section: dict[str, Any]) -> list[str]:
    """Summary lines of the decode-checks ``split_gather`` section (``lab.split_bench``):
    per rank count, the plain gather's and each split variant's median us per call,
    whether it is exact, and the bytes it exchanged per missed byte."""
    lines = []
    for run in section["runs"]:
        head = f"  split gather, {run.get('ranks')} rank(s):"
        if "skipped" in run:
            lines.append(f"{head} skipped ({run['skipped'][:100]})")
            continue
        parts = [f"plain {run.get('plain_us', {}).get('median')} us"]
        for name, v in (run.get("variants") or {}).items():
            parts.append(f"{name} {v.get('us', {}).get('median')} us"
                         f"{'' if v.get('exact') else ' NOT EXACT'} (x{v.get('exchange_per_miss')}"
                         f" exchanged/missed)")
        lines.append(f"{head} miss rate {run.get('miss_rate')}; " + ", ".join(parts))
    return lines


def sglang_lines(report: dict[str, Any]) -> list[str]:
    """Summary lines of the sglang-swap-in step: ours against SGLang's JIT kernel."""
    result = ((report.get("steps", {}).get("sglang-swap-in") or {}).get("result") or {})
    lines = []
    for run in result.get("runs", []):
        head = f"  sglang swap-in miss {run.get('miss_ratio')}:"
        if "error" in run or "skipped" in run:
            lines.append(f"{head} {run.get('error') or 'skipped: ' + run['skipped']}"[:160])
            continue
        t, theirs = run.get("times", {}), run.get("sglang", {})
        graph = run.get("graph", {})
        line = (f"{head} ours {t.get('ours_swap_in_us')} us (resolve "
                f"{t.get('ours_resolve_only_us')}, graph {graph.get('replay_us')}"
                f"{'' if graph.get('exact', True) else ' NOT EXACT'}, replay "
                f"{t.get('ours_replay_us')})")
        if "skipped" in theirs:
            line += f"; SGLang skipped ({theirs['skipped'][:80]})"
        else:
            exact = all((theirs.get("exact") or {"?": False}).values())
            line += (f"; SGLang {theirs.get('sglang_swap_in_us')} us (resolve "
                     f"{theirs.get('sglang_resolve_only_us')}, replay "
                     f"{theirs.get('sglang_replay_us')}); "
                     f"{'bit-exact' if exact else 'DIFFERENT: ' + json.dumps(theirs.get('exact'))}")
        lines.append(line)
    return lines


def plan(args: argparse.Namespace) -> list[Step]:
    """The steps of this run, in order."""
    only = {s for s in (args.only or "").split(",") if s}
    skip = {s for s in args.skip.split(",") if s}
    steps = [s for s in STEPS if (not only or s.name in only) and s.name not in skip]
    if args.dry_run:
        steps = [s for s in steps if s.name in DRY_RUN_STEPS]
    elif args.quick:
        steps = [s for s in steps if s.quick_flags is not None]
    return steps


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT"),
                        help="output folder (default: $OUT)")
    parser.add_argument("--dry-run", action="store_true",
                        help="check the script on any machine: a tiny torch-path bench on the "
                             "CPU, tune --dry-run, one test file")
    parser.add_argument("--quick", action="store_true",
                        help="a shorter rerun: the target measurements on fewer sizes, tune "
                             "for 1 layer, the kernel tests only (budget 240 s)")
    parser.add_argument("--only", default=None, metavar="STEPS",
                        help=f"run only these steps ({','.join(s.name for s in STEPS)})")
    parser.add_argument("--skip", default="", metavar="STEPS", help="steps to leave out")
    parser.add_argument("--budget-s", type=float, default=None,
                        help="no step starts after this many seconds, and every step's limit "
                             "is cut to what is left (default 330, so that the whole check "
                             "ends within 6 minutes; --quick 240)")
    args = parser.parse_args(argv)
    if not args.out:
        parser.error("no output folder: set $OUT or pass --out")
    budget = args.budget_s or (240.0 if args.quick else 330.0)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    log = out / "logs.txt"

    report: dict[str, Any] = {"schema": SCHEMA, "version": VERSION, "dry_run": args.dry_run,
                              "quick": args.quick, "budget_s": budget,
                              "date": date.today().isoformat(), "steps": {}}
    report["install"] = ensure_installed(log)
    sys.path.insert(0, str(ROOT))
    from hisparse_triton.benchmarks.environment import environment
    from hisparse_triton.tuning_cache import device_slug

    env = environment()
    report["environment"] = env
    try:
        report["device_info"] = device_info()
    except Exception as exc:  # noqa: BLE001 - device details must not stop the check
        report["device_info"] = {"error": f"{type(exc).__name__}: {exc}"}
    cuda = bool(env.get("cuda_available"))
    result_path = out / f"{device_slug(env.get('gpu') or 'cpu')}-{report['date']}.json"

    def save() -> None:
        report["wall_s"] = round(time.time() - started, 1)
        text = json.dumps(report, indent=2) + "\n"
        tmp = result_path.with_suffix(".tmp")
        tmp.write_text(text, encoding="utf-8")
        os.replace(tmp, result_path)

    if not cuda and not args.dry_run:
        report["error"] = "no CUDA device: run with --dry-run to check the script"
        save()
        print(f"gpu_check: {report['error']}", file=sys.stderr)
        return 1

    cli = [sys.executable, "-m", "hisparse_triton"]
    cache = out / "tuning-cache.json"
    steps: dict[str, dict[str, Any]] = report["steps"]
    bench_results: list[tuple[str, Optional[dict[str, Any]]]] = []
    save()
    for step in plan(args):
        left = budget - (time.time() - started)
        limit = min(step.quick_limit_s if args.quick else step.limit_s, left - GRACE_S)
        flags = DRY_RUN_FLAGS[step.kind] if args.dry_run else \
            (step.quick_flags if args.quick else step.flags) or ()
        extra_env = {}
        if step.name == "bench-tuned":
            if not cache.exists():
                steps[step.name] = {"skipped": "no tuning cache (tune did not run or failed)"}
                continue
            extra_env = {"HISPARSE_TRITON_TUNING_CACHE": str(cache)}
        if limit < MIN_STEP_S:
            steps[step.name] = {"skipped": f"budget spent ({left:.0f} s left)"}
            save()
            continue
        print(f"gpu_check: {step.name} (limit {limit:.0f} s) ...", flush=True)
        target = out / f"{step.name}.json"
        if step.kind == "tests":
            record = _run(tests_command(tuple(flags), cuda), log, limit)
            record["summary"] = pytest_summary(record["tail"])
        elif step.kind == "decode-checks":
            record = _run([sys.executable, "-m", "lab.decode_checks", "--device", "cuda",
                           *flags, "--json", str(target)], log, limit,
                          env={"PYTHONPATH": os.pathsep.join(
                              p for p in (str(ROOT / "bench"), os.environ.get("PYTHONPATH"))
                              if p)})
            record["result"] = _load_json(target)
        elif step.kind == "sglang":
            record = _run([sys.executable, "-m", "hisparse_triton.benchmarks.sglang_swap_in",
                           "--device", "cuda", *flags, "--json", str(target)], log, limit)
            record["result"] = _load_json(target)
        elif step.kind == "decode":
            record = _run(cli + ["bench", *flags, "--json", str(target)], log, limit)
            record["result"] = _load_json(target)
        elif step.kind == "tune":
            record = _run(cli + ["tune", *flags, "--cache", str(cache), "--json", str(target),
                                 "--no-progress"], log, limit)
            record["result"] = _load_json(target)
        else:
            record = _run(cli + ["bench", *flags, "--json", str(target), "--no-progress"], log,
                          limit, env=extra_env)
            bench_results.append((step.name, _load_json(target)))
        if target.exists():
            target.unlink()  # folded into the one JSON file
        steps[step.name] = record
        print(f"gpu_check: {step.name}: rc={record['rc']}"
              f"{' (timed out)' if record['timed_out'] else ''} in {record['wall_s']} s",
              flush=True)
        bench = merge_bench(bench_results)
        if bench is not None:
            report["bench"] = bench
            report["targets"] = bench["targets"]
        save()

    if report.get("bench"):
        try:
            from hisparse_triton.benchmarks.plot import write_plot

            write_plot(report["bench"], str(out / "bench.png"))
        except Exception as exc:  # noqa: BLE001 - a missing plot must not lose the numbers
            report["plot_error"] = f"{type(exc).__name__}: {exc}"
    save()
    print(f"gpu_check: wrote {result_path}")
    print("\n".join(summary_lines(report)))
    failed = [k for k, s in steps.items() if not s.get("skipped") and s.get("rc") != 0]
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
