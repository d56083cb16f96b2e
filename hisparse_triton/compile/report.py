"""Compile every kernel launch the runtime can make for an NVIDIA or AMD GPU, on any machine.

    python -m hisparse_triton.compile.report --arch sm_90|gfx942 [--json PATH|-]
    hisparse-triton compile-report --arch sm_90|gfx942 [--json PATH|-]    # the same

(AMD targets ``gfx90a`` / ``gfx942`` / ``gfx950``: the same variants and schema, with the
vendor fields ``compile.amd_report`` documents; the NVIDIA fields follow.)

No GPU is needed: the report asks the real launchers what they would launch
(``kernels.resolve.resolve_launch``: the runtime's resolve with counters and a workspace;
``kernels.gather.copy_launch``: the row / page copies of ``gather_rows`` / ``restore_pages``
/ ``backup_rows`` / ``spill_pages``, each with its default config) on CPU tensors of
production shapes, nothing launched, then compiles each launch for the chosen architecture
with Triton's own
launch-time specialisation (the binder a real launch uses: ints equal to 1 become constants,
pointers and ints divisible by 16 get the divisibility hint) and the ``ptxas`` / ``cuobjdump``
that ship with Triton. For each launch it prints:

- ``registers`` per thread; ``stack_bytes`` and ``local_bytes`` per thread (where ``ptxas``
  puts spilled registers) and ``spills`` (true when either is non-zero);
- ``shared_bytes``: the dynamic shared memory Triton asks for at launch;
- ``sass_instructions``: instructions in the cubin (a size, not a time: loops count once);
- ``ctas_per_sm``: resident programs per SM at that register / shared-memory / thread use
  (the CUDA occupancy rules for the architecture: registers allocated per warp in units of
  256, 1 KB of shared memory reserved per CTA), ``limited_by`` naming the binding limit; 0
  means the kernel cannot launch (e.g. shared memory over the per-CTA limit);
- ``grid``: the grid the launcher asked for;
- ``model``: the issue-cycle model of the SASS (``compile/sass_model.py``: issue, ALU and
  shared/LSU cycles per row, dependent-load latency, barriers; ``us_per_call`` at 1, 8, 64
  and 132 rows at the H200 clock); a stated model, not a timing;
- ``store_widths`` (the PTX global store widths, e.g. ``.v4.b32`` = 16 bytes) and
  ``stores_not_loaded`` (stores whose register tuple no load of the same width filled: 0
  means a copy kernel moves its bytes with loads and stores of one width end to end).

Variants (what the runtime can launch): resolve at top-k widths 2,048 ... 32,768 (the largest
``device_buffer_size`` the config accepts), hot buffers up to 32,768 slots, 1 and 64 batch
rows, a production-sized host pool (and a small one where the launcher picks other code),
and every size 1 (Triton specialises ints equal to 1 into constants);
the row / page copies at 132 B (indexer), 656 B (fp8 MLA) and 1,152 B (bf16 MLA) rows for 1,
4 and 61 layers, a gather over tables only 2- or 1-byte aligned (int16 / uint8 words) and one
over pools with more than 2**31 rows (64-bit size arguments); group ``vllm``: the vLLM plugin's
FP8 up-convert gather from device rows, host rows and both; group ``sglang``: the SGLang
plugin's swap-in resolve and its planned copy. Identical specialisations are
compiled once. The JSON document
(``--json``) has the schema ``hisparse-triton/compile-report`` version 1.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import subprocess
import sys
import tempfile
from typing import Any, Callable, Optional, Sequence

from hisparse_triton.compile import sass_model
from hisparse_triton.compile.target_compiler import TargetCompiler

__all__ = ["ARCH_LIMITS", "GROUPS", "RESOLVE_WIDTHS", "arch_flag", "compile_report", "main",
           "occupancy", "report_in_subprocess"]

#: Per-SM limits of the architectures the report knows (CUDA occupancy calculator values).
ARCH_LIMITS: dict[int, dict[str, int]] = {
    80: dict(regs_per_sm=65536, threads_per_sm=2048, ctas_per_sm=32, smem_per_sm=167936,
             smem_per_cta=166912, smem_reserved=1024),
    90: dict(regs_per_sm=65536, threads_per_sm=2048, ctas_per_sm=32, smem_per_sm=233472,
             smem_per_cta=232448, smem_reserved=1024),
    100: dict(regs_per_sm=65536, threads_per_sm=2048, ctas_per_sm=32, smem_per_sm=233472,
              smem_per_cta=232448, smem_reserved=1024),
}
#: Top-k widths of the resolve variants: 2,048 (DeepSeek-V3.2 / GLM-5) up to the largest
#: ``device_buffer_size`` the config accepts (speculative decoding resolves Q x K columns).
RESOLVE_WIDTHS = (2048, 4096, 8192, 16384, 32768)
#: Hot-buffer sizes of the resolve variants (each used with every width it can hold).
RESOLVE_SLOTS = (4096, 8192, 16384, 32768)
ROW_BYTES = (132, 656, 1152)
LAYERS = (1, 4, 61)
#: The launch groups: resolve, the row / page copies, the vLLM plugin's FP8 up-convert.
GROUPS = ("resolve", "copy", "vllm", "sglang")
_BLOCK = 64
_BIG_HOST_BLOCKS = 1_000_000  # 64M host rows: production host pools (int64 sort keys)
_SMALL_HOST_BLOCKS = 4_096    # 256K host rows


def occupancy(arch: int, num_warps: int, registers: int, shared_bytes: int
              ) -> tuple[int, str]:
    """``(ctas_per_sm, limiting resource)`` of a kernel on ``sm_<arch>``."""
    lim = ARCH_LIMITS[arch]
    threads = num_warps * 32
    if shared_bytes > lim["smem_per_cta"]:
        return 0, "shared"
    regs_per_warp = -(-max(registers, 1) * 32 // 256) * 256
    limits = {
        "ctas": lim["ctas_per_sm"],
        "threads": lim["threads_per_sm"] // threads,
        "registers": (lim["regs_per_sm"] // regs_per_warp) // num_warps,
        "shared": lim["smem_per_sm"] // (shared_bytes + lim["smem_reserved"]),
    }
    name = min(limits, key=lambda k: limits[k])
    return limits[name], name


# ------------------------------------------------------------------------------ variants


def _i32(*shape: int):
    import torch

    return torch.zeros(shape, dtype=torch.int32)


def _resolve_calls(widths: Sequence[int], small_host: bool = True
                   ) -> list[tuple[str, Callable[[], Any]]]:
    """``(variant, make)`` of every resolve variant: ``make()`` returns the launches the
    runtime's resolve makes (``kernels.resolve.resolve_launch``: counters, a workspace): the
    sorted kernel's, or the hash kernel's and its fallback launch's."""
    import torch

    from hisparse_triton.kernels import resolve as kres
    from hisparse_triton.ops.resolve.workspace import ResolveWorkspace

    calls = []

    def call(R: int, K: int, H: int, host_blocks: int, S: int = 0, P: int = 128,
             B: int = _BLOCK, device_blocks: int = 100_000) -> Callable[[], Any]:
        def make() -> Any:
            states = S or R + 8
            launches, _ = kres.resolve_launch(
                _i32(R, K), _i32(R), _i32(states), _i32(states, P), _i32(states, P),
                _i32(states, -(-H // B)), _i32(states, H), _i32(states, H), block_size=B,
                num_device_blocks=device_blocks, num_host_blocks=host_blocks,
                counters=torch.zeros(3, dtype=torch.int64), workspace=ResolveWorkspace("cpu"))
            return launches
        return make

    for K in widths:
        for H in (h for h in RESOLVE_SLOTS if h >= K):
            for R in (1, 64):
                calls.append((f"resolve K={K} H={H} R={R}", call(R, K, H, _BIG_HOST_BLOCKS)))
    for K in (k for k in widths if k <= 8192 and small_host):
        calls.append((f"resolve K={K} H={max(K, 4096)} R=64 small-host",
                      call(64, K, max(K, 4096), _SMALL_HOST_BLOCKS)))
    # Every size 1 (Triton turns int arguments equal to 1 into constants).
    calls.append(("resolve K=1 H=1 R=1 ones", call(1, 1, 1, 1, S=1, P=1, B=1,
                                                   device_blocks=1)))
    return calls


def _tables(L: int, row_bytes: int, blocks: int = 4, lead: int = 4096):
    import torch

    from hisparse_triton.row_table import RowTable

    page = _BLOCK * row_bytes
    host = RowTable(torch.empty(lead + L * blocks * page, dtype=torch.uint8),
                    torch.tensor([lead + layer * blocks * page for layer in range(L)]),
                    row_bytes, _BLOCK, page, blocks * _BLOCK)
    dev = RowTable(torch.empty(lead + blocks * L * page, dtype=torch.uint8),
                   torch.tensor([lead + layer * page for layer in range(L)]), row_bytes, _BLOCK,
                   L * page, blocks * _BLOCK)
    return host, dev


def _copy_calls() -> list[tuple[str, Callable[[], Any]]]:
    """``(variant, make)`` of every row / page copy variant: ``make()`` returns the launch
    the launchers make (``kernels.gather.copy_launch``, with each launcher's default
    config: ``gather_rows``, ``backup_rows``, ``restore_pages``, ``spill_pages``)."""
    from hisparse_triton.kernels.gather import copy_launch

    kinds = {
        # a resolve miss plan of 64 requests x top-k 2048 (per-layer plans for followers)
        "gather": lambda h, d, L: copy_launch(d, h, _i32(64, 2048), _i32(64, 2048),
                                              _i32(64), pages=False, kernel="gather"),
        # the write-through of one decode step: a few new rows per request
        "backup": lambda h, d, L: copy_launch(h, d, _i32(64, 4), _i32(64, 4), None,
                                              pages=False, kernel="backup"),
        "restore": lambda h, d, L: copy_launch(d, h, _i32(64, 16), _i32(64, 16), _i32(64),
                                               pages=True, kernel="restore"),
        "spill": lambda h, d, L: copy_launch(h, d, _i32(8, 16), _i32(8, 16), None,
                                             pages=True, kernel="spill"),
    }
    calls = []
    for row in ROW_BYTES:
        for L in LAYERS:
            for kind, fn in kinds.items():
                calls.append((f"{kind} {row}B L={L}",
                              lambda fn=fn, L=L, row=row: fn(*_tables(L, row), L)))
    for lead in (2, 1):  # tables only 2- / 1-byte aligned (never the runtime's pools)
        calls.append((f"gather 132B L=2 lead={lead}", lambda lead=lead: kinds["gather"](
            *_tables(2, 132, lead=lead), 2)))
    calls.append(("gather 656B L=1 i64 sizes", _gather_i64_sizes))
    return calls


def _vllm_calls() -> list[tuple[str, Callable[[], Any]]]:
    """``(variant, make)`` of the vLLM plugin's FP8 up-convert gather (``kernels/vllm_fp8.py``)
    of an 8,192-token prefill workspace for 64 requests: from the device cache, and on the
    staging path from host rows, with and without device rows (``upconvert_launch``)."""
    import torch

    from hisparse_triton.kernels.vllm_fp8 import upconvert_launch

    T, batch, blocks = 8192, 64, 2048
    pages = T // batch // _BLOCK

    def call(host: bool, device_rows: bool) -> Callable[[], Any]:
        def make() -> Any:
            src = torch.empty(blocks, _BLOCK, 656, dtype=torch.uint8)
            dst = torch.empty(T, 576, dtype=torch.bfloat16)
            kw = {}
            if host:
                kw = dict(host_cache=torch.empty(blocks * _BLOCK, 656, dtype=torch.uint8),
                          host_row_ids=_i32(1, batch * pages * _BLOCK))
                if device_rows:
                    kw["device_row_ids"] = _i32(1, batch * pages * _BLOCK)
            return upconvert_launch(src, dst, _i32(batch, pages), _i32(batch), batch, None,
                                    **kw)
        return make

    return [("vllm fp8 upconvert device rows", call(False, False)),
            ("vllm fp8 upconvert host rows", call(True, False)),
            ("vllm fp8 upconvert host+device rows", call(True, True))]


def _sglang_calls() -> list[tuple[str, Callable[[], Any]]]:
    """``(variant, make)`` of the SGLang plugin's kernels (``kernels/sglang_swap_in.py``) at
    production shapes: the swap-in's resolve at top-k 2,048 with 4,096 slots (DeepSeek-V3.2 /
    GLM-5), 1 and 64 rows, a 163,840-token context (int32 sort keys) and a 4M-token one
    (int64 keys); its copy of 656-byte (fp8) and 1,152-byte (bf16) rows."""
    import torch

    from hisparse_triton.kernels import sglang_swap_in as sglang

    K, H = 2048, 4096

    def pool(item: int) -> Any:
        return torch.zeros(4096, item, dtype=torch.uint8)

    def resolve(rows: int, context: int) -> Callable[[], Any]:
        def make() -> Any:
            states = rows + 8
            launch, _ = sglang.swap_in_launches(
                _i32(rows, K), _i32(states, H + 64),
                torch.zeros(states, 1, dtype=torch.int64).expand(states, context),
                _i32(states, H + 64), pool(656), pool(656), _i32(rows, K),
                torch.zeros(rows, dtype=torch.int64), _i32(rows),
                torch.zeros(states, H, dtype=torch.int16), 656, K, H, page_size=1,
                block_size=960, num_real_reqs=_i32(1),
                miss_src=torch.zeros(rows, K, dtype=torch.int64), miss_dst=_i32(rows, K),
                miss_count=_i32(rows), skip_io=True)
            return launch
        return make

    def copy(item: int) -> Callable[[], Any]:
        def make() -> Any:
            return sglang.planned_copy_launch(
                torch.zeros(64, K, dtype=torch.int64), _i32(64, K), _i32(64), _i32(1),
                pool(item), pool(item), item, 64, K, 4096, 4096)
        return make

    return [(f"sglang swap-in K={K} H={H} R={rows} context={context}", resolve(rows, context))
            for rows in (1, 64) for context in (163_840, 1 << 22)] \
        + [(f"sglang swap-in copy {item}B R=64", copy(item)) for item in (656, 1152)]


def _gather_i64_sizes() -> Any:
    """A gather whose pools have more than 2**31 rows and bytes per block (meta tensors: no
    memory), so the launch passes those sizes as 64-bit ints."""
    import torch

    from hisparse_triton.kernels.gather import copy_launch
    from hisparse_triton.row_table import RowTable

    meta, page = torch.device("meta"), _BLOCK * 656
    rows = (1 << 31) + _BLOCK
    host = RowTable(torch.empty(rows * 656, dtype=torch.uint8, device=meta), [0], 656, _BLOCK,
                    page, rows)
    stride = (1 << 31) + page
    dev = RowTable(torch.empty(4 * stride, dtype=torch.uint8, device=meta), [0], 656, _BLOCK,
                   stride, 4 * _BLOCK)
    plan = torch.zeros(64, 2048, dtype=torch.int32, device=meta)
    return copy_launch(dev, host, plan, plan, torch.zeros(64, dtype=torch.int32, device=meta),
                       pages=False, kernel="gather")


# ------------------------------------------------------------------------------ compiling


def _tools() -> tuple[str, str]:
    from triton import knobs

    return knobs.nvidia.ptxas.path, knobs.nvidia.cuobjdump.path


def _cubin_usage(cubin: bytes) -> dict[str, int]:
    """Registers, stack, local (spill) bytes and SASS instruction count of a cubin."""
    tool = _tools()[1]
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        res = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True,
                             check=True).stdout
        sass = subprocess.run([tool, "-sass", f.name], capture_output=True, text=True,
                              check=True).stdout
    finally:
        os.unlink(f.name)
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", res)
    out = dict(zip(("registers", "stack_bytes", "local_bytes"), map(int, m.groups()))) if m \
        else {}
    if m:
        out["spills"] = out["stack_bytes"] + out["local_bytes"] > 0
    out["sass_instructions"] = len(re.findall(r"^\s+/\*[0-9a-f]{4,}\*/\s+\S", sass, re.M))
    return out


def _ptx_accesses(ptx: str) -> dict[str, Any]:
    """Widths of the global stores, and how many stored register tuples no load of the same
    width produced."""
    loads = set(re.findall(r"ld\.global(?:\.[\w:]+)*?((?:\.v\d)?\.b\d+) \{ ([^}]*) \}", ptx))
    stores = re.findall(r"st\.global(?:\.[\w:]+)*?((?:\.v\d)?\.b\d+) \[[^\]]*\], \{ ([^}]*) \}",
                        ptx)
    return {"store_widths": sorted({w for w, _ in stores}),
            "stores_not_loaded": sum((w, regs) not in loads for w, regs in stores)}


class _Compiler(TargetCompiler):
    """Compiles launches for one NVIDIA architecture (``TargetCompiler``): registers
    and spills from the cubin, its SASS for the cost model, PTX accesses, occupancy."""

    def __init__(self, arch: int):
        from triton.backends.compiler import GPUTarget

        self.arch = arch
        super().__init__(GPUTarget("cuda", arch, 32))

    def usage(self, kernel: Any) -> dict[str, Any]:
        info = _cubin_usage(kernel.asm["cubin"])
        info["_sass"] = sass_model.sass_of_cubin(kernel.asm["cubin"])
        info.update(_ptx_accesses(kernel.asm["ptx"]))
        info["shared_bytes"] = int(kernel.metadata.shared)
        info["num_warps"] = int(kernel.metadata.num_warps)
        ctas, limit = occupancy(self.arch, info["num_warps"], info.get("registers", 0),
                                info["shared_bytes"])
        info["ctas_per_sm"], info["limited_by"] = ctas, limit
        return info


def _grid(grid: Any) -> list[int]:
    return [int(g) for g in (grid if isinstance(grid, (tuple, list)) else (grid,))]


def compile_report(arch: int | str = 90, *, groups: Sequence[str] = GROUPS,
                   widths: Sequence[int] = RESOLVE_WIDTHS, small_host: bool = True,
                   progress: Optional[Callable[[str], None]] = None) -> dict[str, Any]:
    """Record and compile every launch of ``groups`` (``GROUPS``); resolve at
    the top-k ``widths`` (plus, with ``small_host``, a host pool small enough for int32 sort
    keys). ``arch``: ``90`` (``sm_90``) ... or an AMD target ``"gfx942"`` (``amd_report``).
    Returns the report payload (``{"arch", "vendor", "warp_size", "triton", "launches"}``,
    AMD adds ``"limits"``).

    Must run without ``TRITON_INTERPRET=1`` (the interpreter replaces the kernels by Python
    functions): use ``report_in_subprocess`` from an interpreted process.
    """
    if os.environ.get("TRITON_INTERPRET") == "1":
        raise RuntimeError("compile_report needs the compiled kernels: unset TRITON_INTERPRET "
                           "(or call report_in_subprocess).")
    from hisparse_triton.compile import amd_report

    amd = amd_report.is_amd_arch(arch)
    if not amd and arch not in ARCH_LIMITS:
        raise ValueError(f"unknown arch sm_{arch}; known: "
                         f"{', '.join(f'sm_{a}' for a in ARCH_LIMITS)}, "
                         f"{', '.join(amd_report.AMD_ARCH_LIMITS)}.")
    import triton

    compiler = amd_report.AmdCompiler(arch) if amd else _Compiler(arch)
    calls = (_resolve_calls(widths, small_host) if "resolve" in groups else []) \
        + (_copy_calls() if "copy" in groups else []) \
        + (_vllm_calls() if "vllm" in groups else []) \
        + (_sglang_calls() if "sglang" in groups else [])
    with _planned_for(compiler):   # the launchers plan for the target (warp size, limits)
        launches = [item for what, make in calls for item in _named(what, make())]
    records: list[dict[str, Any]] = []
    for call, what, launch in launches:
        if launch is None:
            continue
        name = launch.kernel.fn.__name__
        if progress is not None:
            progress(f"{what}: {name}")
        info = compiler.compile(launch.kernel, launch.args, dict(launch.kwargs))
        record = {"variant": what, "call": call, "kernel": name, "grid": _grid(launch.grid),
                  **{k: v for k, v in info.items() if k != "_sass"}}
        if info.get("_sass"):  # the issue-cycle model (compile/sass_model.py; NVIDIA only)
            record["model"] = sass_model.launch_model(
                launch.kernel, info["_sass"], launch.args, dict(launch.kwargs),
                record["grid"], info["num_warps"], info["ctas_per_sm"])
        records.append(record)
    target = compiler.payload() if amd else {"arch": f"sm_{arch}", "vendor": "nvidia",
                                              "warp_size": 32}
    return {**target, "triton": triton.__version__, "launches": records}


def _named(what: str, made: Any) -> list[tuple[str, str, Any]]:
    """``(call, variant, launch)`` of what a ``make()`` returned (``call`` = ``what``): one
    launch (or None), or the launches of one call in order (the hash resolve and its
    fallback launch: the second is named ``"<variant> fallback"``)."""
    if made is None or hasattr(made, "kernel"):  # one launch (a KernelLaunch is a tuple too)
        return [(what, what, made)]
    return [(what, what if i == 0 else f"{what} fallback", launch)
            for i, launch in enumerate(made)]


def _planned_for(compiler: Any):
    """The launchers plan for the compiler's target (warp size, limits) while their launches are made."""
    from hisparse_triton.kernels.launch_config import target_override

    return target_override(compiler.target)


def arch_flag(arch: int | str) -> str:
    """The ``--arch`` value of ``arch`` (``90`` -> ``sm_90``, ``"gfx942"`` unchanged)."""
    return arch if isinstance(arch, str) else f"sm_{arch}"


def report_in_subprocess(arch: int | str = 90, *, groups: Sequence[str] = GROUPS,
                         widths: Sequence[int] = RESOLVE_WIDTHS, small_host: bool = True,
                         timeout: float = 1800) -> dict[str, Any]:
    """``compile_report`` in a fresh interpreter without ``TRITON_INTERPRET`` (usable from
    tests that run the kernels in the interpreter). Returns the JSON document."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "hisparse_triton.compile.report",
           f"--arch={arch_flag(arch)}",
           "--json", "-", "--kernels", ",".join(groups),
           "--widths", ",".join(str(w) for w in widths)] + ([] if small_host
                                                            else ["--no-small-host"])
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise RuntimeError(f"compile report failed ({proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout)


def format_report(payload: dict[str, Any]) -> str:
    if payload.get("vendor") == "amd":
        from hisparse_triton.compile.amd_report import format_amd_report

        return format_amd_report(payload)
    head = (f"{'variant':<40} {'kernel':<28} {'grid':<14} {'warps':>5} {'regs':>4} "
            f"{'spill':>5} {'smem':>7} {'sass':>6} {'cta/SM':>6}")
    lines = [f"compile report for {payload['arch']} (triton {payload['triton']})", head]
    lines += launch_rows(payload["launches"], lambda r: (
        f"{r['num_warps']:>5} {r.get('registers', '?'):>4} "
        f"{r.get('stack_bytes', 0) + r.get('local_bytes', 0):>5} "
        f"{r['shared_bytes']:>7} {r.get('sass_instructions', '?'):>6} {r['ctas_per_sm']:>6}"))
    return "\n".join(lines + NVIDIA_LEGEND)


def launch_rows(launches: Sequence[dict[str, Any]],
                columns: Callable[[dict[str, Any]], str]) -> list[str]:
    """One table line per launch record: variant, kernel and grid, then ``columns(record)``
    (a target's own columns), or ``ERROR`` and the message for a launch that failed."""
    lines = []
    for r in launches:
        grid = "x".join(map(str, r["grid"]))
        start = f"{r['variant']:<40} {r['kernel']:<28} {grid:<14}"
        lines.append(f"{start} ERROR {r['error']}" if r.get("error") else
                     f"{start} {columns(r)}")
    return lines


#: What each column of the NVIDIA table means (printed under it).
NVIDIA_LEGEND = [
    "columns: grid = programs per launch (x by y); warps = warps of 32 threads per program; "
    "regs = registers per thread;",
    "  spill = bytes per thread spilled to memory (ptxas stack + local; 0 = none); smem = "
    "shared memory per program, bytes;",
    "  sass = SASS instructions in the kernel (a size, not a time); cta/SM = programs "
    "resident per SM at these registers, threads and shared memory (0 = does not fit)",
]


if __name__ == "__main__":  # the same as `hisparse-triton compile-report`
    from hisparse_triton.commands.compile_report import main

    sys.exit(main())
