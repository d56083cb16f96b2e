"""The AMD half of the compile report: compile the launchers' launches for ``gfx90a`` / ``gfx942`` /
``gfx950`` (wave64 CDNA GPUs) on any machine and read their resource use from the AMDGPU
assembly Triton's AMD backend produces (``kernel.asm["amdgcn"]``, no GPU, no ROCm install).

``compile.report`` collects the launches (the same variants as for NVIDIA) and hands
each to ``AmdCompiler``; this module only knows the AMD side. Per launch:

- ``vgprs`` (architectural + accumulation registers per lane as allocated, ``.vgpr_count``),
  ``agprs`` (``.agpr_count``), ``sgprs`` (``.sgpr_count``, with VCC / XNACK / flat-scratch);
  ``registers`` = ``vgprs`` (the field NVIDIA reports per thread);
- ``vgpr_spills`` / ``sgpr_spills`` (``.vgpr_spill_count`` / ``.sgpr_spill_count``: SGPRs
  spill into VGPR lanes first, which costs no memory) and ``scratch_bytes`` per lane
  (``.private_segment_fixed_size``); ``spills`` is true for a spill **to memory** (any
  scratch, or any VGPR spill), the criterion the CI fails on;
- ``lds_bytes`` per workgroup: the static group segment (``lds_static_bytes``,
  ``.group_segment_fixed_size``) plus the dynamic LDS Triton asks for at launch
  (``shared_bytes``, the field NVIDIA reports);
- ``waves_per_simd_by_vgprs`` / ``_by_sgprs`` / ``_by_lds``: resident waves per SIMD each
  resource allows (the limits are in the payload's ``limits``), ``workgroups_per_cu`` with
  ``limited_by``, ``waves_per_simd`` at that many workgroups, and ``compiler_occupancy``
  (LLVM's own waves-per-SIMD estimate for the kernel's workgroup size);
- ``instructions`` (machine instructions in the kernel's code: a size, not a time);
- ``barriers`` (``s_barrier``), ``loads_nt`` / ``loads_plain`` and ``stores_nt`` /
  ``stores_plain`` (global / buffer accesses with and without the non-temporal bit, ``nt``
  on gfx942 / gfx950 and ``slc`` on gfx90a: where a ``.cg`` / ``.cs`` hint went),
  ``cas_loops`` (compare-and-swap atomics: an atomic the target lacks, emulated in a loop),
  ``buffer_ops`` (buffer instructions, used for tensors under 2 GiB);
- ``tg_split``: the kernel descriptor's threadgroup-split bit (``.amdhsa_tg_split``); the
  report refuses a target in that mode (``launch_config.check_memory_model``).
"""

from __future__ import annotations

import re
from typing import Any, Optional

from hisparse_triton.compile.report import launch_rows
from hisparse_triton.compile.target_compiler import TargetCompiler

__all__ = ["AMD_ARCH_LIMITS", "AmdCompiler", "amd_occupancy", "asm_usage", "format_amd_report",
           "is_amd_arch", "workgroup_handoff"]

#: Per-CU limits of the CDNA targets (CDNA2 / CDNA3 / CDNA4 ISA guides and LLVM's AMDGPU
#: subtarget tables): a unified 512-entry VGPR file per SIMD lane (architectural + AGPRs)
#: allocated in granules of 8, 800 SGPRs per SIMD in granules of 16, at most 8 waves per SIMD,
#: 4 SIMDs per CU, 1,024 lanes per workgroup (the HIP maximum), LDS per CU (= the most one
#: workgroup may use). ``cus``: the CU count of the product named (for grid sizes).
AMD_ARCH_LIMITS: dict[str, dict[str, Any]] = {
    "gfx90a": dict(product="MI250X (one GCD)", cus=110, wave_size=64, vgprs_per_lane=512,
                   vgpr_granule=8, sgprs_per_simd=800, sgpr_granule=16, max_waves_per_simd=8,
                   simds_per_cu=4, max_workgroup_lanes=1024, lds_per_cu=65536),
    "gfx942": dict(product="MI300X", cus=304, wave_size=64, vgprs_per_lane=512,
                   vgpr_granule=8, sgprs_per_simd=800, sgpr_granule=16, max_waves_per_simd=8,
                   simds_per_cu=4, max_workgroup_lanes=1024, lds_per_cu=65536),
    "gfx950": dict(product="MI355X", cus=256, wave_size=64, vgprs_per_lane=512,
                   vgpr_granule=8, sgprs_per_simd=800, sgpr_granule=16, max_waves_per_simd=8,
                   simds_per_cu=4, max_workgroup_lanes=1024, lds_per_cu=163840),
}

_METADATA = re.compile(r"^---\n(.*?)^\.\.\.$", re.M | re.S)
_INSTRUCTION = re.compile(r"^\t(?:s|v|ds|global|buffer|flat|scratch)_\w+", re.M)


def is_amd_arch(arch: Any) -> bool:
    """Whether ``arch`` names an AMD target (``"gfx942"`` ...), as opposed to ``sm_<n>``."""
    return isinstance(arch, str) and arch.startswith("gfx")


def _ceil(n: int, unit: int) -> int:
    return -(-max(n, 1) // unit) * unit


def amd_occupancy(arch: str, num_warps: int, vgprs: int, sgprs: int, lds_bytes: int
                  ) -> dict[str, Any]:
    """Resident waves per SIMD by each resource, workgroups per CU and the binding limit of a
    workgroup of ``num_warps`` waves on ``arch`` (``AMD_ARCH_LIMITS``)."""
    lim = AMD_ARCH_LIMITS[arch]
    cap = lim["max_waves_per_simd"]
    per_simd = -(-num_warps // lim["simds_per_cu"])  # waves of one workgroup on each SIMD
    by_vgprs = min(cap, lim["vgprs_per_lane"] // _ceil(vgprs, lim["vgpr_granule"]))
    by_sgprs = min(cap, lim["sgprs_per_simd"] // _ceil(sgprs, lim["sgpr_granule"]))
    if num_warps * lim["wave_size"] > lim["max_workgroup_lanes"] or lds_bytes > lim["lds_per_cu"]:
        groups = {"lanes" if num_warps * lim["wave_size"] > lim["max_workgroup_lanes"]
                  else "lds": 0}
        wg_lds = 0
    else:
        wg_lds = lim["lds_per_cu"] // lds_bytes if lds_bytes else 1 << 30
        groups = {"waves": cap // per_simd, "vgprs": by_vgprs // per_simd,
                  "sgprs": by_sgprs // per_simd, "lds": wg_lds}
    name = min(groups, key=lambda k: groups[k])
    return {"waves_per_simd_by_vgprs": by_vgprs, "waves_per_simd_by_sgprs": by_sgprs,
            "waves_per_simd_by_lds": min(cap, wg_lds * per_simd),
            "workgroups_per_cu": groups[name], "limited_by": name,
            "waves_per_simd": groups[name] * per_simd}


def asm_usage(asm: str) -> dict[str, Any]:
    """Resource use of one kernel from its AMDGPU assembly (amdhsa metadata + code)."""
    meta = _METADATA.search(asm.split(".amdgpu_metadata", 1)[-1])
    text = meta.group(1) if meta else ""

    def field(name: str) -> int:
        m = re.search(rf"^\s*(?:- )?\.{name}:\s+(\d+)", text, re.M)
        return int(m.group(1)) if m else 0

    code = asm.split(".Lfunc_end", 1)[0]
    tg = re.search(r"\.amdhsa_tg_split\s+(\d+)", asm)
    occ = re.search(r"^; Occupancy: (\d+)", asm, re.M)
    # non-temporal: the ``nt`` bit on gfx942 / gfx950, ``slc`` on gfx90a
    mem = [(m.group(1), m.group(2), bool(re.search(r"\b(?:nt|slc)\b", m.group(3))))
           for m in re.finditer(r"^\t((?:global|buffer)_(load|store)\w*)([^\n]*)$", code, re.M)]
    out = {
        "vgprs": field("vgpr_count"), "agprs": field("agpr_count"), "sgprs": field("sgpr_count"),
        "vgpr_spills": field("vgpr_spill_count"), "sgpr_spills": field("sgpr_spill_count"),
        "scratch_bytes": field("private_segment_fixed_size"),
        "lds_static_bytes": field("group_segment_fixed_size"),
        "max_workgroup_lanes": field("max_flat_workgroup_size"),
        "wavefront_size": field("wavefront_size"),
        "tg_split": bool(tg and int(tg.group(1))),
        "compiler_occupancy": int(occ.group(1)) if occ else None,
        "instructions": len(_INSTRUCTION.findall(code)),
        "barriers": len(re.findall(r"^\ts_barrier\b", code, re.M)),
        "loads_nt": sum(1 for _, kind, nt in mem if kind == "load" and nt),
        "loads_plain": sum(1 for _, kind, nt in mem if kind == "load" and not nt),
        "stores_nt": sum(1 for _, kind, nt in mem if kind == "store" and nt),
        "stores_plain": sum(1 for _, kind, nt in mem if kind == "store" and not nt),
        "cas_loops": len(re.findall(r"^\t(?:global|buffer|flat)_atomic_cmpswap", code, re.M)),
        "buffer_ops": len(re.findall(r"^\tbuffer_(?:load|store|atomic)", code, re.M)),
    }
    out["registers"] = out["vgprs"]
    out["spills"] = out["scratch_bytes"] > 0 or out["vgpr_spills"] > 0
    return out


class AmdCompiler(TargetCompiler):
    """Compiles launches for one AMD target (``"gfx942"``; ``TargetCompiler``):
    registers, spills, LDS and occupancy from the amdgcn assembly. Same interface as
    ``compile_report``'s NVIDIA compiler."""

    def __init__(self, arch: str):
        from triton.backends.compiler import GPUTarget

        from hisparse_triton.kernels.launch_config import check_memory_model

        name, _, features = arch.partition(":")
        if name not in AMD_ARCH_LIMITS:
            raise ValueError(f"unknown arch {arch!r}; known AMD targets: "
                             f"{', '.join(AMD_ARCH_LIMITS)}.")
        check_memory_model(arch)  # a threadgroup-split target is refused before compiling
        self.arch = name
        self.limits = AMD_ARCH_LIMITS[name]
        super().__init__(GPUTarget("hip", name, self.limits["wave_size"]))

    def usage(self, kernel: Any) -> dict[str, Any]:
        info = asm_usage(kernel.asm["amdgcn"])
        if info["tg_split"]:
            raise RuntimeError("the kernel was compiled in threadgroup-split mode, which "
                               "the resolve hand-offs do not support")
        info["shared_bytes"] = int(kernel.metadata.shared)
        info["lds_bytes"] = info["lds_static_bytes"] + info["shared_bytes"]
        info["num_warps"] = int(kernel.metadata.num_warps)
        info.update(amd_occupancy(self.arch, info["num_warps"], info["vgprs"],
                                  info["sgprs"], info["lds_bytes"]))
        return info

    def payload(self) -> dict[str, Any]:
        """The report fields that describe the target."""
        return {"arch": self.arch, "vendor": "amd", "warp_size": self.target.warp_size,
                "limits": dict(self.limits)}


def format_amd_report(payload: dict[str, Any], title: Optional[str] = None) -> str:
    """The text table of an AMD report payload."""
    head = (f"{'variant':<40} {'kernel':<28} {'grid':<14} {'waves':>5} {'vgpr':>4} "
            f"{'sgpr':>4} {'sspl':>4} {'scr':>4} {'lds':>6} {'insts':>6} {'w/SIMD':>6} "
            f"{'wg/CU':>5} {'limit':<6}")
    lim = payload.get("limits", {})
    lines = [title or f"compile report for {payload['arch']} ({lim.get('product', '?')}, "
                      f"wave{payload.get('warp_size')}, triton {payload['triton']})",
             f"limits: {lim.get('vgprs_per_lane')} VGPRs per SIMD lane (granule "
             f"{lim.get('vgpr_granule')}), {lim.get('sgprs_per_simd')} SGPRs per SIMD, "
             f"{lim.get('max_waves_per_simd')} waves per SIMD, {lim.get('simds_per_cu')} SIMDs "
             f"per CU, {lim.get('lds_per_cu')} B LDS per CU, "
             f"{lim.get('max_workgroup_lanes')} lanes per workgroup", head]
    lines += launch_rows(payload["launches"], lambda r: (
        f"{r['num_warps']:>5} {r['vgprs']:>4} {r['sgprs']:>4} {r['sgpr_spills']:>4} "
        f"{r['scratch_bytes']:>4} {r['lds_bytes']:>6} {r['instructions']:>6} "
        f"{r['waves_per_simd']:>6} {r['workgroups_per_cu']:>5} {r['limited_by']:<6}"))
    return "\n".join(lines + AMD_LEGEND)


#: What each column of the AMD table means (printed under it).
AMD_LEGEND = [
    "columns: grid = workgroups per launch (x by y); waves = wavefronts per workgroup; vgpr = "
    "vector registers per lane; sgpr = scalar registers per wave;",
    "  sspl = SGPRs spilled into VGPR lanes (no memory traffic: not a spill to memory); scr = "
    "scratch bytes per lane (registers spilled to memory; 0 = none);",
    "  lds = LDS bytes per workgroup; insts = machine instructions in the kernel (a size, not a "
    "time); w/SIMD = waves resident per SIMD;",
    "  wg/CU = workgroups resident per CU; limit = what bounds them (waves, vgprs, sgprs, lds, "
    "lanes)",
]


_HANDOFF_IR = r'''
target triple = "amdgcn-amd-amdhsa"
define amdgpu_kernel void @handoff(ptr addrspace(1) %scratch, i32 %v) {
  store i32 %v, ptr addrspace(1) %scratch
  fence syncscope("workgroup") release
  call void @llvm.amdgcn.s.barrier()
  fence syncscope("workgroup") acquire
  %w = load i32, ptr addrspace(1) %scratch
  %x = add i32 %w, 1
  store i32 %x, ptr addrspace(1) %scratch
  ret void
}
declare void @llvm.amdgcn.s.barrier()
'''


def workgroup_handoff(arch: str, tgsplit: bool = False) -> list[str]:
    """The instructions LLVM's AMDGPU backend (the one Triton ships) emits for a hand-off
    between waves of one workgroup through global memory, from the writer's store to the
    reader's load: ``store; fence syncscope("workgroup") release; s_barrier; fence
    syncscope("workgroup") acquire; load`` (what HIP's ``__syncthreads()`` is), compiled for
    ``arch`` without or with threadgroup-split mode. Without it the sequence is the bare
    ``s_barrier`` that ``tl.debug_barrier()`` gives; with it the backend adds a wait for the
    store and an L1 invalidation (docs/kernels.md, "Memory model")."""
    from triton._C.libtriton import amd, llvm

    llvm.init_targets()
    ir, features = _HANDOFF_IR, ""
    if hasattr(amd, "get_target_triple"):
        # Triton 3.9's LLVM: a triple per target; threadgroup split is a function attribute
        # (the "+tgsplit" feature is gone).
        triple = amd.get_target_triple(arch)
        if tgsplit:
            ir = ir.replace(") {", ') "amdgpu-tg-split"="true" {', 1)
    else:  # Triton 3.6 to 3.8: one triple; threadgroup split is a subtarget feature
        triple = amd.TARGET_TRIPLE
        features = "+tgsplit" if tgsplit else ""
    args = [ir, triple, arch, features, [], False, False]
    try:
        asm = llvm.translate_to_asm(*args)
    except TypeError:  # Triton 3.8 adds an argument (canonicalize_gep; off as Triton leaves it)
        asm = llvm.translate_to_asm(*args, False)
    body = asm.split("handoff:", 1)[1].split("s_endpgm", 1)[0]
    code = [line.strip().split(";")[0].strip() for line in body.splitlines()
            if re.match(r"\t[a-z]", line) and not line.startswith("\t.")]
    start = next(i for i, line in enumerate(code) if line.startswith("global_store"))
    end = next(i for i, line in enumerate(code) if line.startswith("global_load"))
    return code[start:end + 1]
