"""Run a test script in a fresh Python process whose kernels are compiled, not interpreted
(``TRITON_INTERPRET`` unset): what the stand-in driver checks need. The script gets the tests
folder as ``sys.argv[1]`` and prints one JSON object on its last line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Optional

TESTS = os.path.dirname(os.path.abspath(__file__))


def run_compiled(script: str, *, extra_env: Optional[dict[str, str]] = None,
                 timeout: float = 900) -> dict:
    """The JSON object ``script`` printed last; fails the test with its error output when
    it exits non-zero."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(extra_env or {})
    proc = subprocess.run([sys.executable, "-c", script, TESTS], env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])
