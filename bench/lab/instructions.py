"""Host cost as instructions: the decode step of ``step_cost`` counted by valgrind's callgrind.

Times on a shared or virtual machine move by tens of percent between runs, and within one run
(the same step takes 1.1 ms or 2.4 ms on this project's 2-core VM); a change of 10 % cannot
be seen in them. The number of instructions the CPU executes for the same Python work does
not move: ``count_instructions`` runs the step of ``step_cost.decode_step`` in a fresh process
under ``valgrind --tool=callgrind`` with instrumentation off, turns it on around ``repeats``
calls of one unit (``callgrind_control``), and takes the difference of two such runs (two
repeat counts), so start-up, imports, compiles and the warm steps drop out. What it counts:
every instruction the process runs in the unit (Python, torch, Triton's launch path, the
stand-in launch); what it does not: time (cache misses, frequency, other load). Compare
figures of one tree against another, not against time targets.

Needs ``valgrind`` and ``callgrind_control`` on the PATH; a run at DeepSeek-V3.2 structure
takes about a minute per repeat count on two cores. ``bench/host_cost.py --instructions``
prints the counts beside the times.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from typing import Any, Callable, Optional

__all__ = ["UNITS", "count_instructions", "instructions_available"]

#: What can be counted: ``DecodeStep`` callable per unit, and what one call is divided by
#: (``"groups"``: the step's index groups, so ``resolve_rows`` is per call).
UNITS = {"step": ("split_step", None), "resolve_rows": ("resolves", "groups"),
         "bookkeeping": ("bookkeeping", None)}

_CHILD = """
import json, os, subprocess, sys
from lab.step_cost import decode_step
job = json.loads(sys.argv[1])
with decode_step(**job["step"]) as step:
    unit = getattr(step, job["callable"])
    control = ["callgrind_control", str(os.getpid())] if job["counted"] else None
    if control:
        subprocess.run(control[:1] + ["--instr=on"] + control[1:], check=True,
                       capture_output=True)
    for _ in range(job["repeats"]):
        unit()
    if control:
        subprocess.run(control[:1] + ["--instr=off"] + control[1:], check=True,
                       capture_output=True)
    print(json.dumps({"groups": len(step.leaders)}))
"""

_COLLECTED = re.compile(r"Collected\s*:\s*([\d,]+)")


def instructions_available() -> bool:
    """Whether valgrind and callgrind_control are on the PATH."""
    return shutil.which("valgrind") is not None and shutil.which("callgrind_control") is not None


def _collected(stderr: str) -> int:
    """The instruction count callgrind reports on exit (``Collected : N``)."""
    match = _COLLECTED.search(stderr)
    if match is None:
        raise RuntimeError(f"callgrind reported no count:\n{stderr[-2000:]}")
    return int(match.group(1).replace(",", ""))


def _warm(job: dict, env: dict, timeout: float) -> None:
    """Run the step once natively: its kernels compiled and cached on disk before the
    counted runs (a compile under valgrind takes minutes)."""
    proc = subprocess.run([sys.executable, "-c", _CHILD, json.dumps(dict(job, repeats=0,
                                                                         counted=False))],
                          env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"the warm-up run failed:\n{proc.stderr[-3000:]}")


def _run_child(job: dict, env: dict, timeout: float) -> tuple[int, dict]:
    with tempfile.TemporaryDirectory() as tmp:
        cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no",
               f"--callgrind-out-file={os.path.join(tmp, 'callgrind.out')}",
               sys.executable, "-c", _CHILD, json.dumps(dict(job, counted=True))]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"the counted run failed:\n{proc.stderr[-3000:]}")
    return _collected(proc.stderr), json.loads(proc.stdout.strip().splitlines()[-1])


def count_instructions(unit: str = "step", *, repeats: tuple[int, int] = (2, 6),
                       launches: str = "standin",
                       timeout: float = 1800, runner: Optional[Callable[..., Any]] = None,
                       **step_kwargs: Any) -> dict[str, Any]:
    """Instructions per ``unit`` (``UNITS``) of the decode step, counted by callgrind (see
    the module docstring). ``repeats``: the two repeat counts whose difference is taken;
    ``launches``: the launch mode (``step_cost._launch_mode``: ``"standin"``,
    ``"standin_bare"``, ``"stubbed"``); ``step_kwargs``: ``step_cost.decode_step``'s sizes
    (``batch``, ``top_k``, ``layers``, ...). ``runner`` replaces the counted run (tests).
    Returns a JSON-able dict; ``ValueError`` for a bad unit or repeats, ``RuntimeError``
    when valgrind is missing or a run fails."""
    if unit not in UNITS:
        raise ValueError(f"unit must be one of {sorted(UNITS)}, got {unit!r}.")
    low, high = repeats
    if not (isinstance(low, int) and isinstance(high, int) and 0 <= low < high):
        raise ValueError(f"repeats must be two ints 0 <= a < b, got {repeats!r}.")
    if runner is None:
        if not instructions_available():
            raise RuntimeError("counting instructions needs valgrind and callgrind_control "
                               "on the PATH.")
        runner = _run_child
    callable_name, per = UNITS[unit]
    from lab import child_env

    env = child_env({k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"})
    step = dict(step_kwargs, launches=launches)
    step.setdefault("steps", high + 2)   # room for every counted step's tokens
    if runner is _run_child:
        _warm({"step": step, "callable": callable_name}, env, timeout)
    counts, info = [], {}
    for n in (low, high):
        count, info = runner({"step": step, "callable": callable_name, "repeats": n}, env,
                             timeout)
        counts.append(count)
    divisor = (high - low) * (info["groups"] if per == "groups" else 1)
    return {"unit": unit, "launches": launches,
            "instructions": round((counts[1] - counts[0]) / divisor),
            "repeats": list(repeats), "collected": counts, "index_groups": info["groups"],
            "step": {k: v for k, v in step.items() if k != "launches"},
            "method": "callgrind instructions, difference of two repeat counts"}
