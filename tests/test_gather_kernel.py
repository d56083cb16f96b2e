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
from hisparse_triton.row_table import RowTable
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
    # The default grid: 32 programs per SM (132 SMs assumed off CUDA), split over 4 layers.
    assert config.grid_programs == 0
    programs = gather.GRID_PROGRAMS_PER_SM * gather.sm_count(torch.device("cpu"))
    assert gather.sm_count(torch.device("cpu")) == gather.DEFAULT_SM_COUNT == 132
    assert big.grid == huge.grid == (programs // 4, 4)
    assert huge.num_items == 1024 * 2048 // big.config.rows_per_program
    capped = gather.launch_shape(dst, src, 1024, 2048, pages=False, kernel="gather",
                                 config=CopyConfig(grid_programs=64))
    assert capped.grid == (16, 4)


@pytest.mark.parametrize("kind", ("inference", "numpy"))
def test_changed_caller_offsets_cannot_make_the_kernel_write_out_of_bounds(kernel_device,
                                                                           kind):
    """The kernel addresses layers through the table's own offsets: changing the tensor the
    table was built from (an inference-mode tensor or a numpy-aliased one, which have no
    working version counter) after first use cannot move a layer outside the pool."""
    from test_copy_reference import _aliased_offsets

    src = make_table(2, 656, 3, layout="host", seed=30, device=kernel_device)
    base = make_table(2, 656, 2, layout="device", seed=31, device=kernel_device)
    offsets, change = _aliased_offsets(kind, list(base.offsets))
    dst = RowTable(base.pool, offsets, 656, base.block_size, base.block_stride,
                          base.num_rows, device=kernel_device)
    s, d, c = random_plan(2, 2, 3, src.num_rows, dst.num_rows, seed=32, device=kernel_device)
    gather.gather_rows(dst, src, s, d, c)  # first use
    change(1, dst.pool.numel() - 16)        # layer 1 would end far past the pool
    expected = naive_copy(dst, src, s, d, c, pages=False)
    gather.gather_rows(dst, src, s, d, c)
    assert torch.equal(dst.pool.cpu(), expected)


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

#: Resolve widths the compile test covers (the report itself goes up to 32768).
COMPILED_WIDTHS = (2048, 8192)


@pytest.fixture(scope="module")
def compiled_launches() -> list[dict]:
    """Every launch of the launchers at production shapes, compiled for sm_90 by
    ``hisparse_triton.compile.report`` (PTX + cubin through the bundled ptxas; no GPU
    needed): resolve at top-k 2048 and 8192, the copies at every row size and layer count.
    Two subprocesses without ``TRITON_INTERPRET`` (resolve, copy) run side by side; ~40 s on
    two cores with a cold Triton cache."""
    from concurrent.futures import ThreadPoolExecutor

    from hisparse_triton.compile import report as compile_report

    try:
        import triton.backends.nvidia  # noqa: F401  (the bundled ptxas / cuobjdump)
    except ImportError as exc:
        pytest.skip(f"no NVIDIA backend in this Triton: {exc}")
    jobs = (dict(groups=("resolve",), widths=COMPILED_WIDTHS, small_host=False),
            dict(groups=("copy",)))
    with ThreadPoolExecutor(2) as pool:
        docs = list(pool.map(lambda kw: compile_report.report_in_subprocess(90, **kw), jobs))
    for doc in docs:
        assert doc["schema"] == "hisparse-triton/compile-report" and doc["arch"] == "sm_90"
    return [r for doc in docs for r in doc["launches"]]


def test_every_kernel_compiles_for_sm90_without_spills(compiled_launches):
    """The interpreter accepts code the compiler rejects (branches binding one name to two
    shapes, bad casts) and says nothing about registers: every launch the launchers make at
    production shapes (resolve at top-k 2048 and 8192 x up to 32768 slots; the copy kernel for
    656 / 1152 / 132 B rows, pages, 1 / 4 / 61 layers, narrow words, 64-bit sizes) compiles
    for sm_90,
    spills nothing and fits the shared memory of an SM (a hash resolve is two launches, the
    second named "<variant> fallback")."""
    kernels = {r["kernel"] for r in compiled_launches}
    assert kernels == {"copy_rows_kernel", "_resolve_kernel", "_resolve_hash_kernel"}
    resolves = [r for r in compiled_launches if r["variant"].startswith("resolve")]
    widths = {int(r["variant"].split("K=")[1].split()[0]) for r in resolves}
    assert widths == set(COMPILED_WIDTHS) | {1}
    assert len({r["variant"] for r in resolves}) == len(resolves)  # one launch per resolve
    assert len(compiled_launches) - len(resolves) == 3 * 3 * 4 + 3
    for r in compiled_launches:
        where = f"{r['variant']} {r['kernel']}: {r}"
        assert r["error"] is None, where
        if "registers" not in r:  # no cuobjdump in this Triton: compiling is all we can check
            continue
        assert not r["spills"], f"spills: {where}"
        assert r["ctas_per_sm"] >= 1, f"cannot launch: {where}"
        # Occupancy guard for the copies: several programs per SM (only the 1- / 2-byte word
        # fallback, never used by the runtime's 4 KiB-aligned pools, holds more words).
        if r["kernel"] == "copy_rows_kernel" and "lead=" not in r["variant"]:
            assert r["registers"] <= 128, f"register use: {where}"


def test_compiled_copy_kernel_moves_16_byte_words(compiled_launches):
    """16-byte aligned spans (656 / 1152 B rows, every page) are stored with ``v4.b32`` and
    each stored vector was loaded by one ``v4.b32`` load; 132 B rows (4-byte aligned) move as
    ``b32``; 2- / 1-byte aligned tables as ``b16`` / ``b8``."""
    copies = {r["variant"]: r for r in compiled_launches if r["kernel"] == "copy_rows_kernel"}
    for what, r in copies.items():
        assert r["stores_not_loaded"] == 0, r  # every store writes registers one load filled
        if what.startswith(("restore", "spill")) or "656B" in what or "1152B" in what:
            assert r["store_widths"] == [".v4.b32"], r
    for what in ("gather 132B L=1", "backup 132B L=61"):
        assert copies[what]["store_widths"] == [".b32"], copies[what]
    assert copies["gather 132B L=2 lead=2"]["store_widths"] == [".b16"]
    assert copies["gather 132B L=2 lead=1"]["store_widths"] == [".b8"]
    assert copies["gather 656B L=1 i64 sizes"]["store_widths"] == [".v4.b32"]


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
    (dict(grid_programs=-1), "grid_programs must be an int >= 0"),
    (dict(rows_per_program=2048, chunk_bytes=1024), "MAX_TILE_ELEMENTS = 1048576"),
])
def test_copy_config_rejects_bad_fields(fields, match):
    with pytest.raises(ValueError, match=match):
        CopyConfig(**fields)


def test_builtin_configs():
    assert builtin_config("gather", 656, 4) == CopyConfig(rows_per_program=8, chunk_bytes=1024)
    assert CopyConfig(rows_per_program=1024, chunk_bytes=1024).rows_per_program == 1024
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
