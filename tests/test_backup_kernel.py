"""Device -> host write-through (backup_rows) and page spill kernels vs the reference.

Same checks as the gather tests in the other direction: the whole host pool (random canary
bytes around and between the layers) must equal the reference's after the launch.
"""

from __future__ import annotations

import pytest
import torch

from hisparse_triton.kernels import backup
from hisparse_triton.tuning import CopyConfig, builtin_config
from test_copy_reference import (HUGE, ROW_SIZES, assert_matches_reference, make_table,
                                 random_plan, run_copy, run_reference, with_pool)

HAS_CUDA = torch.cuda.is_available()


@pytest.mark.parametrize("row_bytes", ROW_SIZES)
@pytest.mark.parametrize("num_layers", (1, 4))
@pytest.mark.parametrize("mode", ("shared", "per_layer", "expanded"))
def test_backup_rows_matches_reference(kernel_device, row_bytes, num_layers, mode):
    src = make_table(num_layers, row_bytes, 4, layout="device", seed=1, device=kernel_device)
    dst = make_table(num_layers, row_bytes, 6, layout="host", seed=2, device=kernel_device)
    s, d, c = random_plan(num_layers, 3, 4, src.num_rows, dst.num_rows, mode=mode, seed=3,
                          device=kernel_device)
    assert_matches_reference(backup.backup_rows, dst, src, s, d, c, pages=False)


def test_backup_many_layers_one_launch(kernel_device):
    """Write-through of a few new rows per request into 9 source layers: the default config
    groups layers 4 per program (groups 4 + 4 + 1), plus a one-program grid-stride launch."""
    src = make_table(9, 656, 2, layout="device", seed=4, device=kernel_device)
    dst = make_table(9, 656, 3, layout="host", seed=5, device=kernel_device)
    assert builtin_config("backup", 656, 9).layers_per_program == 4
    s = torch.tensor([[0], [5], [HUGE]], dtype=torch.int32, device=kernel_device)
    d = torch.tensor([[3], [-1], [11]], dtype=torch.int32, device=kernel_device)
    expected = run_reference(dst, src, s, d, None, pages=False)
    assert torch.equal(run_copy(backup.backup_rows, dst, src, s, d, None), expected)
    one = CopyConfig(rows_per_program=1, layers_per_program=9, grid_programs=1)
    assert torch.equal(run_copy(backup.backup_rows, dst, src, s, d, None, config=one), expected)
    host_rows = with_pool(dst, expected).row_view(8).reshape(-1, 656)
    assert int(host_rows[11].abs().sum()) == 0  # a huge source id zero-fills


@pytest.mark.parametrize("num_layers", (1, 4))
@pytest.mark.parametrize("mode", ("shared", "per_layer"))
def test_spill_pages_matches_reference(kernel_device, num_layers, mode):
    src = make_table(num_layers, 656, 5, layout="device", seed=6, device=kernel_device)
    dst = make_table(num_layers, 656, 6, layout="host", seed=7, device=kernel_device)
    s, d, c = random_plan(num_layers, 2, 3, src.num_blocks, dst.num_blocks, mode=mode, seed=8,
                          device=kernel_device)
    assert_matches_reference(backup.spill_pages, dst, src, s, d, c, pages=True)


@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_backup_production_shape_pinned():
    """64 requests x 64 new rows of 656 B into 8 layers of a pinned host pool."""
    torch.manual_seed(0)
    dev = make_table(8, 656, 128, block_size=64, layout="device", device="cuda")
    host = make_table(8, 656, 512, block_size=64, layout="host", device="cpu",
                      offsets_device="cuda")
    host = with_pool(host, host.pool.pin_memory())
    s = torch.randint(0, dev.num_rows, (64, 64), dtype=torch.int32, device="cuda")
    d = torch.randperm(host.num_rows, device="cuda")[: 64 * 64].int().view(64, 64)
    expected = run_reference(host, dev, s, d, None, pages=False)
    out = host.pool.clone().pin_memory()
    backup.backup_rows(with_pool(host, out), dev, s, d)
    torch.cuda.synchronize()
    assert torch.equal(out, expected)
