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

_COMPILE_SCRIPT = r'''
import json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from hisparse_triton.kernels.gather import copy_rows_kernel as k

CONST = ("HAS_COUNTS", "COLS", "LAYERS", "CHUNK_VECS", "VEC", "WORD_BYTES")

def accesses(word_ty, vec, word, chunk_vecs):
    sig = {}
    for n in k.arg_names:
        if n in CONST:
            sig[n] = "constexpr"
        elif n in ("dst_ptr", "src_ptr"):
            sig[n] = "*" + word_ty
        elif n in ("dst_layers_ptr", "src_layers_ptr"):
            sig[n] = "*i64"
        elif n.endswith("_ptr"):
            sig[n] = "*i32"
        elif n.endswith("block_stride"):
            sig[n] = "i64"
        else:
            sig[n] = "i32"
    consts = dict(HAS_COUNTS=True, COLS=8, LAYERS=1, CHUNK_VECS=chunk_vecs, VEC=vec,
                  WORD_BYTES=word)
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(k.arg_names)
             if n.endswith("_ptr")}
    ptx = triton.compile(ASTSource(k, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                         options={"num_warps": 4}).asm["ptx"]
    pool = "b%d" % (8 * word)
    return sorted({m for m in re.findall(r"(?:ld|st)\.global(?:\.v\d)?\.b\d+", ptx)
                   if m.endswith(pool) or ".v" in m})

print(json.dumps({"wide": accesses("i32", 4, 4, 64), "narrow": accesses("i16", 1, 2, 128)}))
'''


def test_compiled_kernel_uses_16_byte_accesses():
    """Compile copy_rows_kernel for sm_90 (no GPU needed: PTX via the bundled ptxas) and check
    that 16-byte aligned spans move as ``v4.b32`` loads/stores, 2-byte aligned ones as b16."""
    import json
    import os
    import subprocess
    import sys

    env = {**os.environ, "TRITON_INTERPRET": "0"}
    proc = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], env=env, capture_output=True,
                          text=True, timeout=300)
    if proc.returncode != 0 and ("ImportError" in proc.stderr or "ptxas" in proc.stderr):
        pytest.skip(f"cannot compile for sm_90 here: {proc.stderr.strip().splitlines()[-1]}")
    assert proc.returncode == 0, proc.stderr
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "ld.global.v4.b32" in found["wide"] and "st.global.v4.b32" in found["wide"]
    assert found["narrow"] == ["ld.global.b16", "st.global.b16"]


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
        assert tuning.default_config("gather", 656, 2) == builtin_config("gather", 656, 2)
    finally:
        tuning_cache.invalidate()
        tuning.default_config.cache_clear()
