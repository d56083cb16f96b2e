"""The lab: what measures hisparse-triton itself, not shipped in the wheel.

Modules (import them as ``lab.<module>`` with ``bench/`` on ``sys.path``: ``python
bench/<script>.py`` puts it there, the test suite's conftest too):

- ``launches``: ``record_launches``, kernel launches recorded (or counted) instead of run;
- ``standin_driver``: a stand-in CUDA driver, so Triton's real Python launch path runs on a
  machine without a GPU (real sm_90 compiles, the C launch replaced by a recorder);
- ``host_cost``, ``step_cost``: the decode path's host (Python) cost with the launches
  stubbed out or against the stand-in driver; ``instructions``: the same counted in
  instructions by valgrind's callgrind;
- ``decode_checks`` (``bench/gpu_check.py``'s decode-checks step) and its helpers
  ``split_bench`` (the split gather on 2+ GPUs) and ``vllm_ops`` (the vLLM plugin's ops).

Nothing under ``hisparse_triton/`` or ``kernels/`` imports this package
(``tests/test_import_rules.py``).
"""

from __future__ import annotations

import os
from pathlib import Path

#: The ``bench/`` folder (what ``sys.path`` needs for ``import lab``).
BENCH_DIR = Path(__file__).resolve().parent.parent


def child_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` with ``bench/`` first on ``PYTHONPATH``, for a child Python process that imports
    ``lab``."""
    paths = [str(BENCH_DIR)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    return dict(env, PYTHONPATH=os.pathsep.join(paths))
