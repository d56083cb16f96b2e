"""AMD targets on CPU: the compile report for gfx942, launch configs that know the warp size,
the threadgroup-split refusal and the memory-model hand-off the kernels rely on.

The compile tests run Triton's AMD backend in a subprocess (no GPU, no ROCm); they are skipped
with a reason when the installed Triton has no AMD backend."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from hisparse_triton.commands.compile_report import _arch, _check
from hisparse_triton.kernels import launch_config as lc
from hisparse_triton.compile.amd_report import amd_occupancy, asm_usage


def _has_amd_backend() -> bool:
    try:
        from triton.backends import backends

        return "amd" in backends
    except Exception:  # noqa: BLE001
        return False


needs_amd = pytest.mark.skipif(not _has_amd_backend(),
                               reason="the installed Triton has no AMD backend (triton.backends"
                                      ".amd): nothing to compile gfx942 code with")


def _hip(arch: str = "gfx942"):
    from triton.backends.compiler import GPUTarget

    return GPUTarget("hip", arch, 64)


def _run_uninterpreted(code: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------- compile report


@needs_amd
def test_gfx942_report_compiles_the_decode_resolve_without_spills():
    from hisparse_triton.compile.report import report_in_subprocess

    doc = report_in_subprocess("gfx942", groups=("resolve",), widths=(2048,), small_host=False)
    assert doc["schema"] == "hisparse-triton/compile-report"
    assert (doc["arch"], doc["vendor"], doc["warp_size"]) == ("gfx942", "amd", 64)
    assert doc["limits"]["max_workgroup_lanes"] == 1024 and doc["limits"]["lds_per_cu"] == 65536
    launches = doc["launches"]
    assert {r["kernel"] for r in launches} == {"_resolve_kernel", "_resolve_hash_kernel"}
    for r in launches:
        assert r["error"] is None, r
        assert not r["spills"] and r["scratch_bytes"] == 0 and r["vgpr_spills"] == 0, r
        assert 0 < r["vgprs"] <= 512 and 0 < r["sgprs"] and r["instructions"] > 0, r
        assert not r["tg_split"] and r["barriers"] > 0, r
        assert r["num_warps"] * 64 <= 1024 and r["workgroups_per_cu"] >= 1, r
        assert 1 <= r["waves_per_simd_by_vgprs"] <= 8 and r["lds_bytes"] >= r["shared_bytes"]
    production = [r for r in launches if "K=2048" in r["variant"]]
    assert production and all(r["num_warps"] == (8 if r["kernel"] == "_resolve_hash_kernel"
                                                 else 16) for r in production)  # 512 / 1,024
    assert all(r["loads_nt"] > 0 for r in production)  # the .cg loads of the atomic tables


@needs_amd
def test_gfx942_report_of_the_copy_kernels_carries_the_cache_hints():
    doc = _run_uninterpreted("""
        import json
        from hisparse_triton.compile.amd_report import AmdCompiler
        from hisparse_triton.compile.report import _i32, _tables
        from hisparse_triton.kernels.gather import copy_launch
        from hisparse_triton.kernels.launch_config import target_override
        compiler = AmdCompiler("gfx942")
        with target_override(compiler.target):   # what gather_rows / backup_rows launch
            host, dev = _tables(1, 656)
            launches = [copy_launch(dev, host, _i32(64, 2048), _i32(64, 2048), _i32(64),
                                    pages=False, kernel="gather"),
                        copy_launch(host, dev, _i32(64, 4), _i32(64, 4), None, pages=False,
                                    kernel="backup")]
        out = [dict(compiler.compile(l.kernel, l.args, dict(l.kwargs)), grid=list(l.grid))
               for l in launches]
        print(json.dumps(out))
    """)
    gather_info, backup_info = doc
    for r in doc:
        assert r["error"] is None and not r["spills"] and r["num_warps"] == 4, r
    assert gather_info["loads_nt"] > 0 and gather_info["stores_nt"] == 0  # .cg loads -> nt
    assert backup_info["stores_nt"] > 0  # .cs stores into the host pool -> nt
    from hisparse_triton.kernels import gather

    # no device to query: the default SM / CU count, GRID_PROGRAMS_PER_SM per CU
    assert gather_info["grid"][0] == gather.GRID_PROGRAMS_PER_SM * gather.DEFAULT_SM_COUNT


@needs_amd
def test_gfx942_compiles_the_vllm_fp8_upconvert_in_every_form():
    """The vLLM plugin's FP8 up-convert gather compiles for gfx942 from the device cache and
    from host rows (with and without device rows), without spills: the compile report's
    ``vllm`` group (one of the groups CI checks) holds all three launches."""
    doc = _run_uninterpreted("""
        import json
        from hisparse_triton.compile.amd_report import AmdCompiler
        from hisparse_triton.compile.report import _vllm_calls
        from hisparse_triton.kernels.launch_config import target_override
        compiler = AmdCompiler("gfx942")
        with target_override(compiler.target):
            launches = [(what, make()) for what, make in _vllm_calls()]
        print(json.dumps([dict(compiler.compile(l.kernel, l.args, dict(l.kwargs)),
                               variant=what) for what, l in launches]))
    """)
    assert [r["variant"] for r in doc] == ["vllm fp8 upconvert device rows",
                                           "vllm fp8 upconvert host rows",
                                           "vllm fp8 upconvert host+device rows"]
    for r in doc:
        assert r["error"] is None, r
        assert not r["spills"] and r["scratch_bytes"] == 0 and r["instructions"] > 0, r


def test_asm_usage_reads_the_amdhsa_metadata():
    asm = textwrap.dedent("""\
        k:
        \ts_load_dwordx2 s[2:3], s[0:1], 0x0
        \tglobal_load_dword v2, v[2:3], off nt
        \tbuffer_load_dword v3, v1, s[4:7], 0 offen
        \ts_barrier
        \tglobal_atomic_cmpswap v0, v3, v[0:1], s[2:3] glc
        \tglobal_store_dword v[0:1], v2, off nt
        \ts_endpgm
        .Lfunc_end0:
        \t\t.amdhsa_tg_split 1
        ; Occupancy: 5
        \t.amdgpu_metadata
        ---
        amdhsa.kernels:
          - .agpr_count:     4
            .group_segment_fixed_size: 512
            .max_flat_workgroup_size: 1024
            .private_segment_fixed_size: 16
            .sgpr_count:     106
            .sgpr_spill_count: 51
            .vgpr_count:     87
            .vgpr_spill_count: 2
            .wavefront_size: 64
        ...
        \t.end_amdgpu_metadata
        """)
    u = asm_usage(asm)
    assert (u["vgprs"], u["agprs"], u["sgprs"], u["sgpr_spills"], u["vgpr_spills"]) == \
        (87, 4, 106, 51, 2)
    assert (u["scratch_bytes"], u["lds_static_bytes"], u["max_workgroup_lanes"]) == \
        (16, 512, 1024)
    assert u["spills"] and u["tg_split"] and u["compiler_occupancy"] == 5
    assert (u["instructions"], u["barriers"], u["cas_loops"], u["buffer_ops"]) == (7, 1, 1, 1)
    assert (u["loads_nt"], u["loads_plain"], u["stores_nt"], u["stores_plain"]) == (1, 1, 1, 0)
    # SGPR spills into VGPR lanes alone are not a spill to memory.
    assert not asm_usage(asm.replace("16\n", "0\n").replace("spill_count: 2", "spill_count: 0")
                         )["spills"]


def test_amd_occupancy_counts_waves_per_simd_and_workgroups_per_cu():
    # resolve at top-k 2048 on gfx942: 16 waves, 87 VGPRs, 106 SGPRs, 16 KB LDS.
    occ = amd_occupancy("gfx942", 16, 87, 106, 16384)
    assert occ["waves_per_simd_by_vgprs"] == 5 and occ["waves_per_simd_by_sgprs"] == 7
    assert occ["workgroups_per_cu"] == 1 and occ["limited_by"] == "vgprs"
    assert occ["waves_per_simd"] == 4 and occ["waves_per_simd_by_lds"] == 8
    # LDS binds first when a workgroup takes most of it (gfx950 has 160 KB per CU).
    assert amd_occupancy("gfx942", 4, 16, 32, 40_000)["limited_by"] == "lds"
    assert amd_occupancy("gfx950", 4, 16, 32, 40_000)["workgroups_per_cu"] == 4
    # 2,048 lanes cannot launch at all.
    assert amd_occupancy("gfx942", 32, 16, 32, 0)["workgroups_per_cu"] == 0


def test_cli_takes_amd_targets_and_check_fails_on_spills_and_errors():
    assert _arch("gfx942") == "gfx942" and _arch("gfx90a") == "gfx90a" and _arch("sm_90") == 90
    import argparse

    with pytest.raises(argparse.ArgumentTypeError, match="gfx942"):
        _arch("mi300")
    ok = {"variant": "v", "kernel": "k", "error": None, "spills": False}
    assert _check({"launches": [ok]}) == 0
    assert _check({"launches": [ok, dict(ok, spills=True)]}) == 1
    assert _check({"launches": [dict(ok, error="CompilationError: x")]}) == 1
    assert _check({"launches": []}) == 1


# ------------------------------------------------------------------------- launch configs


def test_a_workgroup_over_1024_lanes_is_refused_naming_both_numbers():
    lc.check_workgroup(16, 64, "resolve")
    lc.check_workgroup(32, 32, "resolve")
    with pytest.raises(ValueError, match=r"num_warps=32 x warp size 64 = 2048 lanes.*1024"):
        lc.check_workgroup(32, 64, "resolve", "hip:gfx942")


def test_resolve_refuses_num_warps_hip_cannot_launch_and_leaves_state_unchanged():
    from hisparse_triton.kernels import resolve as kres

    i32 = lambda *s: torch.zeros(s, dtype=torch.int32)  # noqa: E731
    lru = torch.arange(64, dtype=torch.int32).repeat(2, 1)
    before = lru.clone()
    with lc.target_override(_hip()):
        with pytest.raises(ValueError, match=r"num_warps=32 x warp size 64 = 2048"):
            kres._resolve(i32(1, 16), i32(1), i32(2), i32(2, 4), i32(2, 4), i32(2, 1),
                          i32(2, 64), lru, block_size=64, num_device_blocks=4,
                          num_host_blocks=4, num_warps=32)
        # The default on wave64: 16 waves (1,024 lanes) for the sorted kernel's production
        # tiles; the hash kernel (the decode shape's default) takes 8 (512 lanes).
        assert kres._launch(2048, 4096, 64, 1_000_000, True, variant="sorted").num_warps == 16
        assert kres._launch(2048, 4096, 64, 1_000_000, True).num_warps == 8
    assert torch.equal(lru, before)
    from triton.backends.compiler import GPUTarget

    with lc.target_override(GPUTarget("cuda", 90, 32)):  # 32 x 32 = 1,024 threads: fine
        assert kres._launch(2048, 4096, 64, 1_000_000, True, num_warps=32).num_warps == 32


def test_copy_launchers_refuse_num_warps_hip_cannot_launch():
    from hisparse_triton.kernels import gather
    from hisparse_triton.compile.report import _i32, _tables
    from hisparse_triton.tuning import CopyConfig

    host, dev = _tables(1, 132)
    pool = dev.pool.clone()
    with lc.target_override(_hip()):
        with pytest.raises(ValueError, match=r"num_warps=32 x warp size 64"):
            gather.gather_rows(dev, host, _i32(2, 4), _i32(2, 4), _i32(2),
                               config=CopyConfig(num_warps=32))
    assert torch.equal(dev.pool, pool)


def test_resolve_num_warps_never_passes_the_workgroup_limit():
    for warp in (32, 64):
        for tile in (16, 512, 1024, 2048, 4096):
            assert lc.resolve_num_warps(tile, warp) * warp <= lc.MAX_WORKGROUP_LANES
    assert lc.resolve_num_warps(2048, 64) == 16 and lc.resolve_num_warps(2048, None) == 16
    assert lc.resolve_num_warps(2048, 128) == 8


def test_no_target_under_the_interpreter():
    assert os.environ.get("TRITON_INTERPRET") == "1"
    assert lc.current_target() is None and lc.check_launch("resolve", 64) is None


# --------------------------------------------------------------------- threadgroup split


def test_a_threadgroup_split_target_is_refused():
    lc.check_memory_model("gfx942:sramecc+:xnack-", env={})
    lc.check_memory_model("gfx942", env={"TRITON_OVERRIDE_ARCH": "gfx942:xnack-"})
    with pytest.raises(lc.ThreadgroupSplitError, match="gfx942:tgsplit\\+.*threadgroup-split"):
        lc.check_memory_model("gfx942:tgsplit+", env={})
    with pytest.raises(lc.ThreadgroupSplitError, match="TRITON_OVERRIDE_ARCH"):
        lc.check_memory_model("gfx90a", env={"TRITON_OVERRIDE_ARCH": "gfx90a:tgsplit+"})


def test_a_launch_on_a_threadgroup_split_device_is_refused(monkeypatch):
    monkeypatch.setattr(lc, "_device_arch_name", lambda device: "gfx950:tgsplit+")
    with pytest.raises(lc.ThreadgroupSplitError, match="gfx950:tgsplit"):
        lc.check_launch("resolve", 16, target=_hip("gfx950"))
    monkeypatch.setattr(lc, "_device_arch_name", lambda device: "gfx950:sramecc+:xnack-")
    assert lc.check_launch("resolve", 16, target=_hip("gfx950")) is not None


def test_the_compile_report_refuses_a_threadgroup_split_target():
    from hisparse_triton.compile.amd_report import AmdCompiler

    with pytest.raises(lc.ThreadgroupSplitError):
        AmdCompiler("gfx942:tgsplit+")
    with pytest.raises(ValueError, match="gfx1100"):
        AmdCompiler("gfx1100")


@needs_amd
def test_the_barrier_handoff_is_what_llvm_gives_for_workgroup_release_acquire():
    """``tl.debug_barrier()`` is a bare ``s_barrier``; LLVM lowers a workgroup-scope release
    fence + barrier + acquire fence (HIP's ``__syncthreads()``) to the same code without
    threadgroup split, and adds a store wait and an L1 invalidation with it."""
    from hisparse_triton.compile.amd_report import workgroup_handoff

    for arch in ("gfx942", "gfx950"):
        plain = workgroup_handoff(arch)
        assert [line.split()[0] for line in plain] == \
            ["global_store_dword", "s_barrier", "global_load_dword"], plain
        split = workgroup_handoff(arch, tgsplit=True)
        assert "s_waitcnt vmcnt(0)" in split and "buffer_inv sc0" in split, split


# --------------------------------------------------------------------- gpu_check on ROCm


def test_the_environment_of_a_rocm_build_names_the_cus_and_hip(monkeypatch):
    """``bench/gpu_check.py`` records the device through ``benchmarks.environment``: on a
    ROCm build of torch (``torch.version.hip``; ``torch.cuda`` is HIP there) it names the
    gfx target, the CU count and the HIP version, and its summary says HIP."""
    import importlib
    import importlib.util
    from pathlib import Path
    from types import SimpleNamespace

    envmod = importlib.import_module("hisparse_triton.benchmarks.environment")

    props = SimpleNamespace(name="AMD Instinct MI300X", gcnArchName="gfx942:sramecc+:xnack-",
                            multi_processor_count=304, warp_size=64, total_memory=192 << 30,
                            L2_cache_size=4 << 20, major=9, minor=4)
    monkeypatch.setattr(torch.version, "hip", "6.4.43482", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: props)
    monkeypatch.setattr(envmod, "rocm_smi", lambda: {"Card series": "AMD Instinct MI300X"})
    monkeypatch.setattr(envmod, "nvidia_smi", lambda: pytest.fail("nvidia-smi on ROCm"))
    env = envmod.environment()
    assert env["vendor"] == "amd" and env["gpu"] == "AMD Instinct MI300X"
    assert env["cu_count"] == env["sm_count"] == 304 and env["gcn_arch"].startswith("gfx942")
    assert env["hip_runtime"] == "6.4.43482" and env["gpu_count"] == 8
    path = Path(__file__).resolve().parent.parent / "bench" / "gpu_check.py"
    spec = importlib.util.spec_from_file_location("gpu_check_rocm", path)
    gpu_check = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "gpu_check_rocm", gpu_check)  # (dataclasses need it)
    spec.loader.exec_module(gpu_check)
    line = gpu_check.summary_lines({"environment": env, "steps": {}, "wall_s": 1,
                                    "budget_s": 2})[0]
    assert "HIP 6.4.43482 (gfx942:sramecc+:xnack-, 304 CUs)" in line and "CUDA" not in line


def test_the_cli_refuses_a_threadgroup_split_target_in_one_line(capfd):
    from hisparse_triton.cli import main

    assert main(["compile-report", "--arch", "gfx942:tgsplit+"]) == 1
    err = capfd.readouterr().err
    assert "threadgroup-split" in err and "Traceback" not in err
