"""``hisparse_triton.integrations.vllm.register()``: vLLM 0.33's five ops appear under
``torch.ops._C_cache_ops`` with vLLM's schemas, route to the backend
``HISPARSE_TRITON_BACKEND`` names, trace under ``torch.compile`` (fake kernels, declared
mutations), and leave vLLM's own ops alone unless overridden. vLLM is not needed here: the
"vLLM's own op" case is simulated in a subprocess by defining one op first.

Schemas are vLLM 0.33.0's (read from its compiled ``_C_stable_libtorch`` extension's op
registry and the call sites in ``vllm/v1/hisparse/runtime.py`` / ``vllm/_custom_ops.py``).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from hisparse_triton.integrations import vllm as plugin
from hisparse_triton.integrations import vllm_reference
from vllm_op_cases import random_resolve_case, resolve_args

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))))


@pytest.fixture(scope="module", autouse=True)
def registered():
    assert plugin.register() is True
    return plugin.providers()


def test_all_five_ops_are_ours_with_vllms_schemas(registered):
    assert registered == {name: "hisparse_triton" for name in plugin.OP_NAMES}
    for name, schema in plugin.SCHEMAS.items():
        op = getattr(torch.ops._C_cache_ops, name).default
        want = torch._C.parse_schema(f"_C_cache_ops::{schema}")
        assert str(op._schema) == str(want), name
    # vLLM's own readiness check (vllm/v1/hisparse/runtime.py: _has_hisparse_ops)
    assert all(hasattr(torch.ops._C_cache_ops, name) for name in plugin.HISPARSE_OPS)


def test_register_again_is_cheap_and_logs_nothing_new(caplog):
    with caplog.at_level(logging.INFO, logger=plugin.__name__):
        assert plugin.register() is True
    assert not caplog.records


class _Recorder:
    def __init__(self, launches: list):
        self.launches = launches

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append(grid)


@pytest.mark.parametrize("backend,launches", [("torch", 0), ("triton", 1)])
def test_calls_route_to_the_named_backend(monkeypatch, backend, launches):
    from hisparse_triton.kernels import vllm_residency

    if backend == "triton" and os.environ.get("TRITON_INTERPRET") != "1" \
            and not torch.cuda.is_available():
        pytest.skip("the Triton backend needs CUDA or TRITON_INTERPRET=1")
    seen: list = []
    monkeypatch.setattr(vllm_residency, "_invalidate_kernel", _Recorder(seen))
    monkeypatch.setenv("HISPARSE_TRITON_BACKEND", backend)
    dgi = torch.tensor([[4, 5, 4, -1]], dtype=torch.int32)
    torch.ops._C_cache_ops.hisparse_invalidate_written_slots(
        dgi, torch.tensor([0], dtype=torch.int32), torch.tensor([0], dtype=torch.int32),
        torch.tensor([4], dtype=torch.int64))
    assert len(seen) == launches
    if backend == "torch":
        assert dgi.tolist() == [[-1, 5, -1, -1]]


def test_unknown_backend_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("HISPARSE_TRITON_BACKEND", "cuda-graphs")
    with pytest.raises(ValueError, match="cuda-graphs"):
        torch.ops._C_cache_ops.hisparse_invalidate_written_slots(
            torch.zeros(1, 4, dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
            torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int64))


def test_resolve_through_the_dispatcher_matches_the_model(monkeypatch):
    monkeypatch.setenv("HISPARSE_TRITON_BACKEND", "torch")
    case = random_resolve_case(np.random.default_rng(4), rows_per_request=[2, 1], top_k=8,
                               hot_size=16)
    args, outs = resolve_args(case)
    want_args, want = resolve_args(case)
    torch.ops._C_cache_ops.hisparse_resolve_residency(*args)
    vllm_reference.hisparse_resolve_residency(*want_args)
    for key in outs:
        assert torch.equal(outs[key], want[key]), key


def test_ops_trace_under_torch_compile(monkeypatch):
    """aot_eager traces with fake tensors and functionalises the declared mutations: the
    compiled function must write the same tensors as eager calls."""
    monkeypatch.setenv("HISPARSE_TRITON_BACKEND", "torch")
    case = random_resolve_case(np.random.default_rng(6), rows_per_request=[1, 2], top_k=8,
                               hot_size=16)

    def step(args, host, hot):
        torch.ops._C_cache_ops.hisparse_resolve_residency(*args)
        torch.ops._C_cache_ops.hisparse_gather_compact(host, hot, args[19], args[20], args[21])

    eager_args, eager = resolve_args(case)
    host = torch.randint(0, 255, (case.host_rows, 16), dtype=torch.uint8)
    hot = torch.zeros(case.hot_num_blocks, case.hot_block_size, 16, dtype=torch.uint8)
    hot_eager = hot.clone()
    step(eager_args, host, hot_eager)
    compiled_args, compiled = resolve_args(case)
    torch._dynamo.reset()
    torch.compile(step, backend="aot_eager", fullgraph=True)(compiled_args, host, hot)
    for key in eager:
        assert torch.equal(compiled[key], eager[key]), key
    assert torch.equal(hot, hot_eager) and hot.any()


def test_fake_kernels_run_under_fake_tensors():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        dgi = mode.from_tensor(torch.zeros(2, 8, dtype=torch.int32))
        torch.ops._C_cache_ops.hisparse_invalidate_written_slots(
            dgi, torch.zeros(2, dtype=torch.int32), torch.zeros(3, dtype=torch.int32),
            torch.zeros(3, dtype=torch.int64))


def _python(code: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": ROOT, **env}, capture_output=True,
                          text=True, timeout=120)


VLLM_OWN_OP = """
    import torch
    # Stand-in for vLLM's compiled op: same schema, a kernel that marks its call.
    lib = torch.library.Library("_C_cache_ops", "FRAGMENT")
    lib.define("hisparse_invalidate_written_slots(Tensor! device_global_indices, "
               "Tensor request_state_indices, Tensor req_id_per_token, "
               "Tensor written_slots) -> ()")

    def mark(dgi, *rest):
        dgi.fill_(777)

    lib.impl("hisparse_invalidate_written_slots", mark, "CPU")
    from hisparse_triton.integrations import vllm as plugin

    def call():
        dgi = torch.zeros(1, 4, dtype=torch.int32)
        torch.ops._C_cache_ops.hisparse_invalidate_written_slots(
            dgi, torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
            torch.zeros(1, dtype=torch.int64))
        return int(dgi[0, 0])
"""


def test_vllms_own_op_is_kept_unless_overridden():
    result = _python(VLLM_OWN_OP + """
    active = plugin.register()
    kept = call()
    who = plugin.providers()["hisparse_invalidate_written_slots"]
    print(active, kept, who, plugin.providers()["hisparse_gather_plan"])
    print(plugin.register(override=True), call(),
          plugin.providers()["hisparse_invalidate_written_slots"])
    """, HISPARSE_TRITON_BACKEND="torch")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "777", "vllm", "hisparse_triton",
                                     "True", "-1", "hisparse_triton"]


def test_override_environment_variable():
    result = _python(VLLM_OWN_OP + """
    print(plugin.register(), call())
    """, HISPARSE_TRITON_BACKEND="torch", HISPARSE_TRITON_VLLM_OVERRIDE="1")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "-1"]


def test_importing_the_plugin_imports_no_vllm():
    result = _python("""
    import sys
    import hisparse_triton, hisparse_triton.integrations.vllm as plugin
    plugin.register()
    print(any(m == "vllm" or m.startswith("vllm.") for m in sys.modules))
    """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
