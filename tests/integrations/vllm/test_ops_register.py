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


VLLM_ALL_OPS = """
    import logging, sys, torch
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s %(message)s")
    from hisparse_triton.integrations import vllm as plugin
    from hisparse_triton.ops import registry
    # Stand-ins for vLLM's compiled ops: vLLM 0.33's schemas, kernels that mark their call.
    lib = torch.library.Library("_C_cache_ops", "FRAGMENT")
    SCHEMAS = dict(plugin.SCHEMAS, **SCHEMA_CHANGES)
    for name in plugin.OP_NAMES:
        lib.define(SCHEMAS[name])
        lib.impl(name, lambda *args, name=name: CALLED.append(name), "CPU")
    CALLED = []

    def call(name):
        CALLED.clear()
        dgi = torch.zeros(1, 4, dtype=torch.int32)
        if name == "hisparse_invalidate_written_slots":
            torch.ops._C_cache_ops.hisparse_invalidate_written_slots(
                dgi, torch.zeros(1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32),
                torch.zeros(1, dtype=torch.int64))
        else:  # the FP8 up-convert of one request's 4 rows
            torch.ops._C_cache_ops.cp_gather_and_upconvert_fp8_kv_cache(
                torch.zeros(2, 4, 656, dtype=torch.uint8),
                torch.zeros(4, 576, dtype=torch.bfloat16), torch.ones(1, 1, dtype=torch.int32),
                torch.zeros(1, dtype=torch.int32), 1, None)
        return "vllm" if CALLED == [name] else "ours"

    def report(active):
        ours = sorted(k for k in registry.OP_TABLE if k.startswith("_C_cache_ops::"))
        print("RESULT", active, plugin.providers(), call("hisparse_invalidate_written_slots"),
              call("cp_gather_and_upconvert_fp8_kv_cache"), ours)
"""


def _registered(code: str, schema_changes: str = "{}", **env: str) -> tuple[str, str]:
    result = _python(textwrap.dedent(VLLM_ALL_OPS.replace("SCHEMA_CHANGES", schema_changes))
                     + textwrap.dedent(code), HISPARSE_TRITON_BACKEND="torch", **env)
    assert result.returncode == 0, result.stderr
    line = next(line for line in result.stdout.splitlines() if line.startswith("RESULT"))
    return line, result.stderr


def test_with_vllms_compiled_ops_and_no_override_nothing_changes():
    line, log = _registered("report(plugin.register())")
    providers = {name: "vllm" for name in plugin.OP_NAMES}
    assert line == f"RESULT False {providers} vllm vllm []"
    assert "hisparse-triton: none; vLLM: " in log


@pytest.mark.parametrize("value", ["1", "hisparse"])
def test_the_override_replaces_the_hisparse_ops_and_keeps_vllms_fp8_upconvert(value):
    """vLLM runs ``cp_gather_and_upconvert_fp8_kv_cache`` for FP8 MLA prefill without
    HiSparse too: the HiSparse override leaves it to vLLM."""
    line, _ = _registered("report(plugin.register())", HISPARSE_TRITON_VLLM_OVERRIDE=value)
    providers = {name: "hisparse_triton" for name in plugin.HISPARSE_OPS}
    providers["cp_gather_and_upconvert_fp8_kv_cache"] = "vllm"
    ours = sorted(f"_C_cache_ops::{name}" for name in plugin.HISPARSE_OPS)
    assert line == f"RESULT True {providers} ours vllm {ours}"


def test_the_override_all_replaces_the_fp8_upconvert_too():
    line, _ = _registered("report(plugin.register())", HISPARSE_TRITON_VLLM_OVERRIDE="all")
    providers = {name: "hisparse_triton" for name in plugin.OP_NAMES}
    ours = sorted(f"_C_cache_ops::{name}" for name in plugin.OP_NAMES)
    assert line == f"RESULT True {providers} ours ours {ours}"
    line, _ = _registered("report(plugin.register('hisparse')); report(plugin.register('all'))")
    assert line.startswith("RESULT True") and line.endswith("ours vllm " + str(sorted(
        f"_C_cache_ops::{name}" for name in plugin.HISPARSE_OPS)))


def test_a_bad_override_value_is_refused_naming_it(monkeypatch):
    monkeypatch.setenv(plugin.OVERRIDE_ENV, "yes")
    with pytest.raises(ValueError, match="HISPARSE_TRITON_VLLM_OVERRIDE .*'all'.* got 'yes'"):
        plugin.register()
    with pytest.raises(ValueError, match="got 'everything'"):
        plugin.register(override="everything")


REFUSED = {name: None for name in plugin.OP_NAMES}


def test_another_vllm_schema_is_refused_and_nothing_is_registered():
    changes = repr({"hisparse_gather_compact": "hisparse_gather_compact(Tensor host_cache, "
                    "Tensor! hot_cache, Tensor miss_global_indices, Tensor miss_counts) -> ()"})
    line, log = _registered("report(plugin.register('all')); print(plugin.register('all'))",
                            changes)
    assert line == f"RESULT False {REFUSED} vllm vllm []"
    assert "registers none (vLLM's _C_cache_ops::hisparse_gather_compact has the schema" in log
    assert log.count("registers none") == 1  # logged once


FAKE_VLLM = """
    import types
    sys.modules["vllm"] = types.SimpleNamespace(__version__=VERSION)  # a running vLLM
"""


@pytest.mark.parametrize("version,accepted", [("0.34.0", False), ("0.32.1", False),
                                              ("1.33.0", False), ("0.33.2+cu129", True)])
def test_the_running_vllms_version_must_be_033(version, accepted):
    """A fake running vLLM of another release: refused, nothing registered (its own ops, the
    stand-ins, stay); a 0.33 patch release is accepted."""
    code = textwrap.dedent(FAKE_VLLM.replace("VERSION", repr(version))) \
        + "report(plugin.register('all'))"
    line, log = _registered(code)
    if accepted:
        assert line.startswith("RESULT True") and " ours ours " in line
    else:
        assert line == f"RESULT False {REFUSED} vllm vllm []"
        assert f"registers none (vLLM {version} is running, but these ops implement vLLM " \
               "0.33's schemas and semantics)" in log


def test_the_version_is_read_from_the_installed_distribution(tmp_path):
    """Before vLLM is imported, its distribution's metadata says which vLLM is installed."""
    info = tmp_path / "vllm-0.35.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\nVersion: 0.35.0\n")
    result = _python("""
    import torch
    from hisparse_triton.integrations import vllm as plugin
    print(plugin.register(), plugin.providers(),
          hasattr(torch.ops._C_cache_ops, "hisparse_resolve_residency"))
    """, PYTHONPATH=f"{tmp_path}{os.pathsep}{ROOT}")
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[0] == f"False {REFUSED} False"
    assert "vLLM 0.35.0 is running" in result.stderr


def test_importing_the_plugin_imports_no_vllm():
    result = _python("""
    import sys
    import hisparse_triton, hisparse_triton.integrations.vllm as plugin
    plugin.register()
    print(any(m == "vllm" or m.startswith("vllm.") for m in sys.modules))
    """)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "False"
