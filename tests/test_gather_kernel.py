"""Host -> device gather and page restore kernels vs the reference, bit-exact.

Runs under ``TRITON_INTERPRET=1`` on CPU (small shapes) and on CUDA when present. The whole
destination pool (random canary bytes around, between and after the rows) is compared with the
reference's, so a stray write anywhere in the pool fails the test.
"""

from __future__ import annotations

import pytest
import torch

from hisparse_triton.kernels import gather
from hisparse_triton import tuning
from hisparse_triton.tuning import CopyConfig, builtin_config
from test_copy_reference import (HUGE, ROW_SIZES, assert_matches_reference, make_table,
                                 naive_copy, random_plan, run_copy, with_pool)

HAS_CUDA = torch.cuda.is_available()

#: Small launch shapes that exercise every loop of the kernel: grid-stride items (grid smaller
#: than the work), partial layer groups, several chunk steps per row, narrow accesses.
CONFIGS = {
    "default": None,
    "strided": CopyConfig(rows_per_program=2, layers_per_program=3, chunk_bytes=64,
                          grid_programs=4),
    "narrow": CopyConfig(rows_per_program=4, access_bytes=4, chunk_bytes=16, grid_programs=2),
}


@pytest.mark.parametrize("row_bytes", ROW_SIZES)
@pytest.mark.parametrize("num_layers", (1, 4))
@pytest.mark.parametrize("mode", ("shared", "per_layer", "expanded"))
def test_gather_rows_matches_reference(kernel_device, row_bytes, num_layers, mode):
    src = make_table(num_layers, row_bytes, 6, layout="host", seed=1, device=kernel_device)
    dst = make_table(num_layers, row_bytes, 4, layout="device", seed=2, device=kernel_device)
    s, d, c = random_plan(num_layers, 3, 5, src.num_rows, dst.num_rows, mode=mode, seed=3,
                          device=kernel_device)
    assert_matches_reference(gather.gather_rows, dst, src, s, d, c, pages=False)


@pytest.mark.parametrize("config", list(CONFIGS), ids=str)
@pytest.mark.parametrize("row_bytes", (132, 656))
def test_gather_launch_configs(kernel_device, config, row_bytes):
    src = make_table(4, row_bytes, 5, layout="host", seed=4, device=kernel_device)
    dst = make_table(4, row_bytes, 4, layout="device", seed=5, device=kernel_device)
    s, d, c = random_plan(4, 3, 5, src.num_rows, dst.num_rows, mode="per_layer", seed=6,
                          device=kernel_device)
    assert_matches_reference(gather.gather_rows, dst, src, s, d, c, pages=False,
                             config=CONFIGS[config])


@pytest.mark.parametrize("lead", (1, 2, 4, 8))
def test_gather_unaligned_offsets(kernel_device, lead):
    """Offsets only 1/2/4/8-byte aligned: narrower words, same bytes."""
    src = make_table(2, 132, 5, layout="host", lead=lead, gap=lead, seed=7, device=kernel_device)
    dst = make_table(2, 132, 4, layout="device", lead=3 * lead, gap=lead, seed=8,
                     device=kernel_device)
    s, d, c = random_plan(2, 3, 4, src.num_rows, dst.num_rows, mode="per_layer", seed=9,
                          device=kernel_device)
    shape = gather.launch_shape(dst, src, 3, 4, pages=False, kernel="gather")
    assert shape.access_bytes == min(lead, 4)
    assert_matches_reference(gather.gather_rows, dst, src, s, d, c, pages=False)


def test_gather_no_counts_zero_fill_and_skip(kernel_device):
    src = make_table(2, 16, 2, seed=10, device=kernel_device)
    dst = make_table(2, 16, 3, layout="device", seed=11, device=kernel_device)
    s = torch.tensor([[0, 7, -1, HUGE, -HUGE - 1, 3]], dtype=torch.int32, device=kernel_device)
    d = torch.tensor([[11, 0, 5, 6, 7, 12]], dtype=torch.int32, device=kernel_device)
    out = run_copy(gather.gather_rows, dst, src, s, d, None)
    assert torch.equal(out.cpu(), naive_copy(dst, src, s, d, None, pages=False))
    rows = with_pool(dst, out).row_view(0).reshape(-1, 16)
    assert int(rows[5].abs().sum()) == int(rows[6].abs().sum()) == int(rows[7].abs().sum()) == 0


def test_all_destinations_out_of_range_touch_nothing(kernel_device):
    src = make_table(3, 656, 3, seed=12, device=kernel_device)
    dst = make_table(3, 656, 2, layout="device", seed=13, device=kernel_device)
    s = torch.arange(8, dtype=torch.int32, device=kernel_device).view(2, 4)
    d = torch.tensor([[-1, 8, 9, HUGE], [-HUGE - 1, -2, 100, 8]], dtype=torch.int32,
                     device=kernel_device)
    assert torch.equal(run_copy(gather.gather_rows, dst, src, s, d, None), dst.pool)


@pytest.mark.parametrize("num_layers", (1, 4))
@pytest.mark.parametrize("mode", ("shared", "per_layer"))
def test_restore_pages_matches_reference(kernel_device, num_layers, mode):
    src = make_table(num_layers, 132, 7, layout="host", seed=14, device=kernel_device)
    dst = make_table(num_layers, 132, 6, layout="device", seed=15, device=kernel_device)
    s, d, c = random_plan(num_layers, 2, 3, src.num_blocks, dst.num_blocks, mode=mode, seed=16,
                          device=kernel_device)
    assert_matches_reference(gather.restore_pages, dst, src, s, d, c, pages=True)
    strided = CopyConfig(rows_per_program=2, layers_per_program=3, chunk_bytes=256,
                         grid_programs=2)
    assert_matches_reference(gather.restore_pages, dst, src, s, d, c, pages=True,
                             config=strided)


def test_launch_shape_is_wide_and_capped():
    """16-byte accesses for aligned 656 B rows; the grid is fixed once the plan outgrows it."""
    src = make_table(4, 656, 2, layout="host")
    dst = make_table(4, 656, 2, layout="device")
    config = builtin_config("gather", 656, 4)
    small = gather.launch_shape(dst, src, 1, 64, pages=False, kernel="gather", config=config)
    assert small.access_bytes == 16 and small.word_bytes == 4 and small.chunk_vecs == 64
    assert small.grid == (64 // small.config.rows_per_program, 4)  # one request: 8 x 4 programs
    big = gather.launch_shape(dst, src, 256, 2048, pages=False, kernel="gather", config=config)
    huge = gather.launch_shape(dst, src, 1024, 2048, pages=False, kernel="gather",
                               config=config)
    assert big.grid == huge.grid == (big.config.grid_programs // 4, 4)
    assert huge.num_items == 1024 * 2048 // big.config.rows_per_program


def test_bad_arguments_leave_the_pool_unchanged(kernel_device):
    src = make_table(2, 16, 2, seed=17, device=kernel_device)
    dst = make_table(2, 16, 2, seed=18, device=kernel_device)
    before = dst.pool.clone()
    ok = torch.zeros(1, 2, dtype=torch.int32, device=kernel_device)
    with pytest.raises(ValueError, match="int32"):
        gather.gather_rows(dst, src, ok.long(), ok)
    with pytest.raises(ValueError, match="counts"):
        gather.gather_rows(dst, src, ok, ok, torch.zeros(3, dtype=torch.int32,
                                                         device=kernel_device))
    with pytest.raises(ValueError, match="unknown kernel"):
        gather.launch_copy(dst, src, ok, ok, None, pages=False, kernel="nope")
    assert torch.equal(dst.pool, before)


# --------------------------------------------------------------------------- CUDA only


@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
@pytest.mark.parametrize("num_layers", (1, 4))
def test_gather_production_shape_pinned(num_layers):
    """656 B rows, 64 requests x 128 misses = 8192 rows per layer, pinned host pool."""
    torch.manual_seed(0)
    host = make_table(num_layers, 656, 2048, block_size=64, layout="host", device="cpu",
                      offsets_device="cuda")
    host = with_pool(host, host.pool.pin_memory())
    dev = make_table(num_layers, 656, 160, block_size=64, layout="device", device="cuda")
    rows, cols = 64, 2048
    s = torch.randint(-2, host.num_rows + 2, (rows, cols), dtype=torch.int32, device="cuda")
    d = torch.randperm(dev.num_rows, device="cuda")[: rows * 128].int()
    d = torch.cat([d.view(rows, 128), torch.full((rows, cols - 128), -1, device="cuda",
                                                 dtype=torch.int32)], 1)
    c = torch.full((rows,), 128, dtype=torch.int32, device="cuda")
    assert_matches_reference(gather.gather_rows, dev, host, s, d, c, pages=False)


@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_unpinned_host_pool_is_refused_on_cuda():
    host = make_table(1, 656, 4, device="cpu", offsets_device="cuda")
    dev = make_table(1, 656, 4, layout="device", device="cuda")
    plan = torch.zeros(1, 1, dtype=torch.int32, device="cuda")
    before = dev.pool.clone()
    with pytest.raises(ValueError, match="not pinned"):
        gather.gather_rows(dev, host, plan, plan)
    assert torch.equal(dev.pool, before)


# ------------------------------------------------------------- compiled code (no GPU needed)

#: Runs the real launchers at production shapes with every @triton.jit kernel replaced by a
#: recorder, then compiles each recorded launch for sm_90 (PTX + cubin through the bundled
#: ptxas; no GPU needed) with the argument specialisation Triton applies at launch (ints
#: equal to 1 become constexprs, ints and pointers divisible by 16 get the divisibility hint,
#: ints beyond int32 are i64). Prints one JSON record per launch: registers, spills, and the
#: widths of the global stores with whether each stored register tuple was loaded by one load
#: of the same width (for the copy kernel every store is a pool store, so that proves the
#: bytes move with 16-byte accesses end to end).
_COMPILE_SCRIPT = r"""
import json, os, re, subprocess, sys, tempfile
import torch
import triton
try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    import triton.backends.nvidia as nv
except ImportError as e:
    print("SKIP no triton compile API:", e); sys.exit(0)
BIN = os.path.join(os.path.dirname(nv.__file__), "bin")
if not os.path.exists(os.path.join(BIN, "ptxas")):
    print("SKIP no bundled ptxas"); sys.exit(0)
from hisparse_triton.kernels import backup, gather, resolve as kres
from hisparse_triton.row_table import RowTable

TYPES = {torch.int8: "i8", torch.uint8: "u8", torch.int16: "i16", torch.int32: "i32",
         torch.int64: "i64"}
RESOLVE = ("_resolve_sort_kernel", "_resolve_search_kernel", "_resolve_classify_kernel",
           "_resolve_lru_kernel", "_resolve_finalize_kernel")
launches, tag = [], ["?"]

class Recorder:
    def __init__(self, fn):
        self.fn = fn
    def __getitem__(self, grid):
        return lambda *args, **kwargs: launches.append((tag[0], self.fn, args, kwargs))

for name in RESOLVE:
    setattr(kres, name, Recorder(getattr(kres, name)))
gather.copy_rows_kernel = Recorder(gather.copy_rows_kernel)
kres._check_backend = lambda device: None  # CPU tensors stand in for CUDA ones

def specialize(fn, args, kwargs, force_i64=()):
    opts = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
    sig, consts, attrs = {}, {}, {}
    for i, n in enumerate(fn.arg_names):
        v = args[i] if i < len(args) else kwargs[n]
        if i >= len(args) or not isinstance(v, torch.Tensor) and v == 1:
            sig[n], consts[n] = "constexpr", v
            continue
        if isinstance(v, torch.Tensor):
            sig[n], aligned = "*" + TYPES[v.dtype], v.data_ptr() % 16 == 0
        else:
            big = n in force_i64 or not -2**31 <= v < 2**31
            sig[n], aligned = ("i64" if big else "i32"), v % 16 == 0 and n not in force_i64
        if aligned:
            attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, consts, attrs, opts

def usage(cubin):
    tool = os.path.join(BIN, "cuobjdump")
    if not os.path.exists(tool):
        return {}
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    out = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True).stdout
    os.unlink(f.name)
    m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:\d+ LOCAL:(\d+)", out)
    return dict(zip(("regs", "stack", "local"), map(int, m.groups()))) if m else {}

def flush(force_i64=()):
    for what, fn, args, kwargs in launches:
        sig, consts, attrs, opts = specialize(fn, args, dict(kwargs), force_i64)
        k = triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                           options=opts)
        ptx = k.asm["ptx"]
        loads = set(re.findall(r"ld\.global((?:\.v\d)?\.b\d+) \{ ([^}]*) \}", ptx))
        stores = re.findall(r"st\.global((?:\.v\d)?\.b\d+) \[[^\]]*\], \{ ([^}]*) \}", ptx)
        print(json.dumps(dict(
            usage(k.asm["cubin"]), what=what, kernel=fn.__name__, warps=opts.get("num_warps"),
            stores=sorted({w for w, _ in stores}),
            unloaded_stores=sum((w, regs) not in loads for w, regs in stores))))
    launches.clear()

def i32(*shape):
    return torch.zeros(shape, dtype=torch.int32)

B = 64
GROUP = sys.argv[1]  # "resolve" or "copy": the test runs the two in parallel processes
for R, K, H in ((64, 2048, 4096), (64, 2048, 32768), (8, 64, 128)) * (GROUP == "resolve"):
    S, P = R + 8, 128
    tag[0] = f"resolve R={R} K={K} H={H}"
    kres.resolve(i32(R, K), i32(R), i32(S), i32(S, P), i32(S, P), i32(S, H // B), i32(S, H),
                 i32(S, H), block_size=B, num_device_blocks=100_000, num_host_blocks=1_000_000)
    flush()
if GROUP != "copy":
    print("OK"); sys.exit(0)

def tables(L, row_bytes, lead=16, blocks=4):
    page = B * row_bytes
    host = RowTable(torch.empty(lead + L * blocks * page, dtype=torch.uint8),
                    torch.tensor([lead + l * blocks * page for l in range(L)]), row_bytes, B,
                    page, blocks * B)
    dev = RowTable(torch.empty(lead + blocks * L * page, dtype=torch.uint8),
                   torch.tensor([lead + l * page for l in range(L)]), row_bytes, B, L * page,
                   blocks * B)
    return host, dev

CALLS = {
    "gather": (1, lambda h, d: gather.gather_rows(d, h, i32(64, 2048), i32(64, 2048), i32(64))),
    "gather per-layer": (4, lambda h, d: gather.gather_rows(
        d, h, i32(4, 64, 2048), i32(4, 64, 2048), i32(64))),
    "backup": (61, lambda h, d: backup.backup_rows(h, d, i32(64, 4), i32(64, 4))),
    "restore": (61, lambda h, d: gather.restore_pages(d, h, i32(64, 16), i32(64, 16), i32(64))),
    "spill": (1, lambda h, d: backup.spill_pages(h, d, i32(8, 16), i32(8, 16))),
}
for row in (656, 1152, 132):
    for what, (L, call) in CALLS.items():
        if row == 132 and what == "gather per-layer":
            continue
        tag[0] = f"{what} {row}B L={L}"
        call(*tables(L, row))
        flush()
for lead in (2, 1):  # tables only 2- / 1-byte aligned: int16 / uint8 words
    tag[0] = f"gather 132B lead={lead}"
    host, dev = tables(2, 132, lead=lead)
    gather.gather_rows(dev, host, i32(64, 2048), i32(64, 2048), i32(64))
    flush()
tag[0] = "gather 656B i64 sizes"  # pools with more than 2**31 spans / bytes per block
gather.gather_rows(*reversed(tables(1, 656)), i32(64, 2048), i32(64, 2048), i32(64))
flush(force_i64=("src_block_stride", "dst_block_stride", "src_num_spans", "dst_num_spans"))
print("OK")
"""


@pytest.fixture(scope="module")
def compiled_launches() -> list[dict]:
    """Compile every kernel launch of the launchers at production shapes for sm_90: two
    subprocesses without ``TRITON_INTERPRET`` (resolve, copy) run side by side; ~15 s on two
    cores with a cold Triton cache (the 2048-key sort kernel alone takes ~5 s)."""
    import json
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    procs = [subprocess.Popen([sys.executable, "-c", _COMPILE_SCRIPT, group], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for group in ("resolve", "copy")]
    records = []
    for proc in procs:
        out, err = proc.communicate(timeout=600)
        assert proc.returncode == 0, err[-4000:]
        if out.startswith("SKIP"):
            pytest.skip(out.strip())
        lines = out.strip().splitlines()
        assert lines[-1] == "OK", out[-2000:]
        records += [json.loads(line) for line in lines[:-1]]
    return records


def test_every_kernel_compiles_for_sm90_without_spills(compiled_launches):
    """The interpreter accepts code the compiler rejects (branches binding one name to two
    shapes, bad casts) and says nothing about registers: every launch the launchers make at
    production shapes (resolve at top-k 2048 x 4096 / 32768 slots and a small shape; the copy
    kernel for 656 / 1152 / 132 B rows, pages, 1 / 4 / 61 layers, narrow words, i64 sizes)
    compiles for sm_90, spills nothing to local memory and keeps the register count low
    enough for several programs per SM."""
    kernels = {r["kernel"] for r in compiled_launches}
    assert kernels == {"copy_rows_kernel", "_resolve_sort_kernel", "_resolve_search_kernel",
                       "_resolve_classify_kernel", "_resolve_lru_kernel",
                       "_resolve_finalize_kernel"}
    assert len(compiled_launches) == 3 * 5 + 3 * 5 - 1 + 3
    for r in compiled_launches:
        if "regs" not in r:  # no cuobjdump in this Triton: compiling is all we can check
            continue
        where = f"{r['what']} {r['kernel']}: {r}"
        assert r["local"] == 0 and r["stack"] == 0, f"spills: {where}"
        # Occupancy guard: several programs per SM. Only the 1- / 2-byte word fallback (never
        # used by the runtime's 4 KiB-aligned pools) holds 16-32 words per thread and more.
        narrow = "lead=" in r["what"]
        limit = 255 if narrow else 128 if r["kernel"] == "copy_rows_kernel" else 168
        assert r["regs"] <= limit, f"register use: {where}"


def test_compiled_copy_kernel_moves_16_byte_words(compiled_launches):
    """16-byte aligned spans (656 / 1152 B rows, every page) are stored with ``v4.b32`` and
    each stored vector was loaded by one ``v4.b32`` load; 132 B rows (4-byte aligned) move as
    ``b32``; 2- / 1-byte aligned tables as ``b16`` / ``b8``."""
    copies = {r["what"]: r for r in compiled_launches if r["kernel"] == "copy_rows_kernel"}
    for what, r in copies.items():
        assert r["unloaded_stores"] == 0, r  # every store writes registers one load filled
        if what.startswith(("restore", "spill")) or "656B" in what or "1152B" in what:
            assert r["stores"] == [".v4.b32"], r
    for what in ("gather 132B L=1", "backup 132B L=61"):
        assert copies[what]["stores"] == [".b32"], copies[what]
    assert copies["gather 132B lead=2"]["stores"] == [".b16"]
    assert copies["gather 132B lead=1"]["stores"] == [".b8"]


# ------------------------------------------------------------------------ launch configs


def test_pow2_alignment():
    assert tuning.pow2_alignment(656, 41984, 0) == 16
    assert tuning.pow2_alignment(132) == 4
    assert tuning.pow2_alignment(656, 3) == 1
    assert tuning.pow2_alignment(48, cap=8) == 8


@pytest.mark.parametrize("fields,match", [
    (dict(rows_per_program=3), "rows_per_program must be a power of two"),
    (dict(access_bytes=32), "access_bytes must be <= 16"),
    (dict(chunk_bytes=8), "chunk_bytes=8 is smaller than access_bytes=16"),
    (dict(grid_programs=0), "grid_programs must be a positive int"),
])
def test_copy_config_rejects_bad_fields(fields, match):
    with pytest.raises(ValueError, match=match):
        CopyConfig(**fields)


def test_builtin_configs():
    assert builtin_config("gather", 656, 4) == CopyConfig(rows_per_program=8, chunk_bytes=1024)
    assert builtin_config("gather", 16, 1).rows_per_program == 256
    assert builtin_config("backup", 656, 61).layers_per_program == 4
    assert builtin_config("spill", 64 * 656, 61) == CopyConfig(rows_per_program=1,
                                                               chunk_bytes=4096)
    with pytest.raises(ValueError, match="unknown kernel 'copy'"):
        tuning.default_config("copy", 656, 1)


def test_default_config_prefers_the_tuned_cache(tmp_path, monkeypatch):
    from hisparse_triton import tuning_cache

    monkeypatch.setenv(tuning_cache.ENV_VAR, str(tmp_path / "cache.json"))
    tuning_cache.invalidate()
    tuning.default_config.cache_clear()
    try:
        assert tuning.default_config("gather", 656, 4) == builtin_config("gather", 656, 4)
        cache = tuning_cache.TuningCache.load()
        tuned = CopyConfig(rows_per_program=16, chunk_bytes=256, num_warps=8)
        cache.put(tuning_cache.TuningEntry("gather", 656, 4, config=dict(
            rows_per_program=16, chunk_bytes=256, num_warps=8)))
        cache.save()
        tuning.default_config.cache_clear()
        assert tuning.default_config("gather", 656, 4) == tuned
        # another layer count takes the nearest tuned shape; another row size the built-in
        assert tuning.default_config("gather", 656, 2) == tuned
        assert tuning.default_config("gather", 132, 4) == builtin_config("gather", 132, 4)
    finally:
        tuning_cache.invalidate()
        tuning.default_config.cache_clear()
