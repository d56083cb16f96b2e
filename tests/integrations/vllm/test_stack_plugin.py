"""vLLM 0.33.0 loads this project's ops the way it loads any general plugin.

Every vLLM process (API server, engine core, workers) calls
``vllm.plugins.load_general_plugins()``, which runs each ``vllm.general_plugins`` entry point
with no arguments, once per process, unless ``VLLM_PLUGINS`` leaves it out. Each test runs in
a fresh interpreter: ops, once registered, stay for the process's life.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.needs_vllm

PROBE = textwrap.dedent("""
    import json, logging
    logging.basicConfig(level=logging.INFO, format="%(name)s %(message)s")
    import torch
    from vllm.plugins import load_general_plugins
    from vllm.v1.hisparse.runtime import _has_hisparse_ops
    before = _has_hisparse_ops()
    load_general_plugins()
    load_general_plugins()  # a process loads its plugins once
    from hisparse_triton.integrations import vllm as plugin
    print("RESULT " + json.dumps({"before": before, "after": _has_hisparse_ops(),
                                  "providers": plugin.providers()}))
""")


def _probe(**env: str) -> tuple[dict, str]:
    environment = {name: value for name, value in os.environ.items() if name != "VLLM_PLUGINS"}
    environment.update(env)
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                          env=environment, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))
    return json.loads(line[len("RESULT "):]), done.stderr


def test_entry_point_is_declared_for_vllm():
    from importlib.metadata import entry_points

    points = {point.name: point.value for point in entry_points(group="vllm.general_plugins")}
    assert points.get("hisparse_triton") == "hisparse_triton.integrations.vllm:register"


def test_vllm_plugin_loader_registers_our_ops_once():
    result, log = _probe()
    assert result["before"] is False  # the CPU wheel has no compiled _C_cache_ops
    assert result["after"] is True  # what HiSparseRuntime checks before it starts
    assert set(result["providers"].values()) == {"hisparse_triton"}
    lines = [line for line in log.splitlines() if "vLLM HiSparse ops:" in line]
    assert len(lines) == 1 and "hisparse-triton" in lines[0], log[-2000:]


def test_vllm_plugins_allow_list_is_honoured():
    result, _ = _probe(VLLM_PLUGINS="hisparse_triton")
    assert result["after"] is True
    result, _ = _probe(VLLM_PLUGINS="lora_filesystem_resolver")
    assert result["after"] is False
    assert set(result["providers"].values()) == {None}
