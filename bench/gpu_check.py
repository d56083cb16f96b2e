#!/usr/bin/env python3
"""One prepared GPU check: the test suite on CUDA, the full ``bench`` sweep and ``tune`` for
656 B rows, all written as ONE JSON file (plus logs) under ``$OUT``.

Usage on a GPU machine, from the repository root::

    OUT=/some/dir python3 bench/gpu_check.py            # at most --budget-s (540 s)
    OUT=/some/dir python3 bench/gpu_check.py --quick    # bench --quick: a few minutes

and on any machine, to check the script itself (torch paths only, CPU)::

    OUT=/tmp/x python3 bench/gpu_check.py --dry-run

Steps (each a subprocess with its own time limit inside the ``--budget-s`` total; at its
limit a step gets SIGINT, and a bench stopped that way still writes the figures it has; the
JSON is rewritten after every step, so a run stopped from outside keeps what finished):

0. make ``hisparse_triton.kernels`` importable (``pip install -e . --no-deps
   --no-build-isolation`` when the package is not installed: offline, setuptools only);
1. ``pytest tests`` (CUDA present: the kernels run on the GPU, GPU-only tests included);
2. ``hisparse-triton bench`` for 656 B rows, then for resolve (``BENCH_PIECES``);
3. ``hisparse-triton tune --row-bytes 656 --kernel gather,backup --layers 1,4 --quick``
   into ``$OUT/tuning-cache.json`` (the user's cache is not touched);
4. ``bench`` for 132 and 1152 B rows;
5. a short ``bench`` of gather/backup with that cache (the tuned configs' effect).

Output (4 files, inside the device tool's limits): ``$OUT/<gpu-slug>-<YYYY-MM-DD>.json``
(commit it as ``bench/results/<gpu-slug>-<YYYY-MM-DD>.json``) with the environment (GPU
name, driver, torch, triton, CUDA), every step's exit code, time and output tail, the merged
bench result, the tune result and where each DESIGN.md section 9 target stands;
``bench.png`` (the merged plot), ``logs.txt`` (every step's output) and
``tuning-cache.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from datetime import date
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = "hisparse-triton/gpu-check"
#: Seconds a step may take to write its partial results after SIGINT at its time limit.
GRACE_S = 20


def _run(cmd: list[str], log: Path, timeout: float, env: Optional[dict] = None) -> dict:
    """Run ``cmd`` in the repository root, appending its output to ``log``; a summary dict
    (``rc`` None when it ran past ``timeout`` seconds and was killed)."""
    start = time.time()
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})}
    rc: Optional[int] = None
    timed_out = timeout <= 0
    with open(log, "a", encoding="utf-8") as handle:
        handle.write("\n$ " + " ".join(cmd) + "\n")
        handle.flush()
        begin = handle.tell()
        if not timed_out:
            proc = subprocess.Popen(cmd, cwd=ROOT, stdout=handle, stderr=subprocess.STDOUT,
                                    env=full_env)
            try:
                rc = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                # SIGINT first: bench writes the figures it has; then kill.
                timed_out = True
                proc.send_signal(signal.SIGINT)
                try:
                    rc = proc.wait(timeout=GRACE_S)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
    with open(log, encoding="utf-8", errors="replace") as handle:
        handle.seek(begin)
        text = handle.read()
    return {"cmd": cmd, "rc": rc, "timed_out": timed_out, "wall_s": round(time.time() - start, 1),
            "tail": text[-3000:]}


def _pytest_summary(text: str) -> dict[str, int]:
    """Counts from pytest's last summary line (``3 passed, 1 skipped in 2.0s``)."""
    counts: dict[str, int] = {}
    lines = [l for l in text.splitlines() if re.search(r"\b(passed|failed|error)", l)]
    if lines:
        for n, what in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed|"
                                  r"deselected|warnings?)", lines[-1]):
            counts[what.rstrip("s") if what.startswith(("error", "warning")) else what] = int(n)
    return counts


def _load_json(path: Path) -> Optional[Any]:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError):
        return None


def _ensure_installed(log: Path, report: dict) -> None:
    probe = [sys.executable, "-c", "import hisparse_triton.kernels, hisparse_triton.cli"]
    if subprocess.run(probe, cwd=ROOT, capture_output=True).returncode == 0:
        report["install"] = {"rc": 0, "note": "already importable"}
        return
    report["install"] = _run([sys.executable, "-m", "pip", "install", "-q", "--no-deps",
                              "--no-build-isolation", "-e", str(ROOT)], log, timeout=300)


#: Bench pieces, most important first (each its own subprocess and JSON, merged after).
BENCH_PIECES = (
    ("bench-656", ["--row-bytes", "656", "--ops", "gather,backup,restore,spill"]),
    ("bench-resolve", ["--ops", "resolve"]),
    ("bench-132", ["--row-bytes", "132", "--ops", "gather,backup,restore,spill"]),
    ("bench-1152", ["--row-bytes", "1152", "--ops", "gather,backup,restore,spill"]),
)


def merge_bench(results: list[dict]) -> Optional[dict]:
    """One bench result from the pieces' results (targets re-evaluated on the union)."""
    from hisparse_triton.benchmarking import evaluate_targets

    results = [r for r in results if r]
    if not results:
        return None
    merged = dict(results[0])
    merged["transfers"] = [f for r in results for f in r.get("transfers", [])]
    merged["resolve"] = [f for r in results for f in r.get("resolve", [])]
    merged["wall_s"] = round(sum(r.get("wall_s", 0) for r in results), 1)
    merged["pieces"] = [r.get("settings") for r in results]
    merged.pop("settings", None)
    merged["targets"] = evaluate_targets(merged)
    return merged


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT"),
                        help="output folder (default: $OUT)")
    parser.add_argument("--dry-run", action="store_true",
                        help="check the script on any machine: a few tests, a tiny torch-path "
                             "bench on the CPU, tune --dry-run")
    parser.add_argument("--quick", action="store_true",
                        help="bench --quick (656 B rows only) and a smaller test run")
    parser.add_argument("--skip", default="", metavar="STEPS",
                        help="comma-separated steps to skip: tests,bench,tune,bench_tuned")
    parser.add_argument("--pytest-args", default=None,
                        help="arguments for pytest (default: 'tests -q -p no:cacheprovider'; "
                             "dry run: the tuning-cache tests)")
    parser.add_argument("--tune-args", default="--kernel gather,backup --layers 1,4 --quick",
                        help="extra arguments of tune (656 B rows are always used; default "
                             "'%(default)s')")
    parser.add_argument("--budget-s", type=float, default=540,
                        help="stop starting steps after this many seconds; every step's "
                             "time limit is cut to what is left (default %(default)s)")
    parser.add_argument("--tests-timeout", type=float, default=180)
    parser.add_argument("--bench-timeout", type=float, default=150, help="per bench piece")
    parser.add_argument("--tune-timeout", type=float, default=150)
    args = parser.parse_args(argv)
    if not args.out:
        parser.error("no output folder: set $OUT or pass --out")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    skip = {s for s in args.skip.split(",") if s}
    started = time.time()
    log = out / "logs.txt"

    def left(limit: float) -> float:
        return max(0.0, min(limit, args.budget_s - (time.time() - started) - GRACE_S))

    report: dict[str, Any] = {"schema": SCHEMA, "version": 1, "dry_run": args.dry_run,
                              "quick": args.quick, "date": date.today().isoformat(),
                              "steps": {}}
    _ensure_installed(log, report)
    sys.path.insert(0, str(ROOT))
    from hisparse_triton.benchmarking import environment
    from hisparse_triton.tuning_cache import device_slug

    env = environment()
    report["environment"] = env
    cuda = bool(env.get("cuda_available"))
    result_path = out / f"{device_slug(env.get('gpu') or 'cpu')}-{report['date']}.json"

    def save() -> None:
        report["wall_s"] = round(time.time() - started, 1)
        result_path.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")

    if not cuda and not args.dry_run:
        report["error"] = "no CUDA device: run with --dry-run to check the script"
        save()
        print(f"gpu_check: {report['error']}", file=sys.stderr)
        return 1

    cli = [sys.executable, "-m", "hisparse_triton"]
    steps = report["steps"]

    if "tests" not in skip:
        default = ("tests/test_tuning_cache.py -q -p no:cacheprovider" if args.dry_run
                   else "tests -q -p no:cacheprovider")
        pytest_args = (args.pytest_args or default).split()
        step = _run([sys.executable, "-m", "pytest", *pytest_args], log,
                    left(args.tests_timeout))
        step["summary"] = _pytest_summary(step["tail"])
        steps["tests"] = step
        save()

    def bench_piece(name: str, flags: list[str], extra_env: Optional[dict] = None) -> None:
        target = out / f"{name}.json"
        flags = [*flags, "--json", str(target), "--no-progress"]
        if args.dry_run:
            flags += ["--quick", "--device", "cpu"]
        elif args.quick:
            flags += ["--quick"]
        step = _run(cli + ["bench", *flags], log, left(args.bench_timeout), env=extra_env)
        step["result"] = _load_json(target)  # partial when the step was interrupted
        if target.exists():
            target.unlink()  # folded into the one JSON file
        steps[name] = step
        save()

    pieces = BENCH_PIECES[:1] if args.dry_run else BENCH_PIECES
    if args.quick:
        pieces = BENCH_PIECES[:2]
    if "bench" not in skip:
        bench_piece(*pieces[0])
        if len(pieces) > 1:
            bench_piece(*pieces[1])

    cache = out / "tuning-cache.json"
    if "tune" not in skip:
        tune_json = out / "tune.json"
        flags = ["--row-bytes", "656", *args.tune_args.split(), "--cache", str(cache),
                 "--json", str(tune_json), "--no-progress"]
        if args.dry_run:
            flags.append("--dry-run")
        step = _run(cli + ["tune", *flags], log, left(args.tune_timeout))
        step["result"] = _load_json(tune_json)
        if tune_json.exists():
            tune_json.unlink()
        steps["tune"] = step
        save()

    if "bench" not in skip:
        for piece in pieces[2:]:
            bench_piece(*piece)

    if "bench_tuned" not in skip and not args.dry_run and cache.exists():
        bench_piece("bench-tuned", ["--row-bytes", "656", "--ops", "gather,backup",
                                    "--rows", "4k,32k,256k", "--miss-ratios", "1"],
                    extra_env={"HISPARSE_TRITON_TUNING_CACHE": str(cache)})

    bench = merge_bench([steps[name]["result"] for name, _ in BENCH_PIECES
                         if name in steps])
    if bench is not None:
        report["bench"] = bench
        report["targets"] = bench["targets"]
        for name, _ in BENCH_PIECES:
            if name in steps:
                steps[name].pop("result", None)
        try:
            from hisparse_triton.benchmarking import write_plot

            write_plot(bench, str(out / "bench.png"))
        except Exception as exc:  # noqa: BLE001 - a missing plot must not lose the numbers
            report["plot_error"] = f"{type(exc).__name__}: {exc}"
    save()

    failed = [k for k, s in steps.items() if s.get("rc") != 0]
    print(f"gpu_check: wrote {result_path} in {report['wall_s']} s; steps: " +
          ", ".join(f"{k}={'ok' if s.get('rc') == 0 else 'TIMEOUT' if s.get('timed_out') else 'FAILED'}"
                    for k, s in steps.items()))
    for target in report.get("targets") or []:
        ratio = target.get("ratio")
        print(f"  {target['target']}: {target['status']}"
              + (f" ({ratio:.2f} of target, worst {target['worst']} {target['unit']})"
                 if ratio is not None else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
