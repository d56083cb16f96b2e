"""``PoolLayers``: each layer's rows in the two pools, and the views a model uses."""

from __future__ import annotations

import pytest
import torch

from worker_helpers import B, L0, make_pair


def test_row_tables_address_the_planned_tensors():
    scheduler, worker = make_pair()
    with worker:
        layers, groups = worker._layers, worker.groups
        ig = groups.index_groups[0]
        device_table, host_table, row_bytes = layers.row_tables(ig.layers)
        assert row_bytes == layers.row_bytes(ig.leader, host=True)
        assert device_table.offsets == tuple(
            groups.device_tensors[groups.resident_layer_name[x]].offset for x in ig.layers)
        assert host_table.offsets == tuple(groups.host_tensors[x].offset for x in ig.layers)
        assert host_table.num_rows == worker.num_host_blocks * B
        assert device_table.num_rows == worker.num_device_blocks * B
        assert device_table.block_stride == worker.bytes_per_block
        assert host_table.block_stride == B * row_bytes
        assert device_table.pool.data_ptr() == worker.device_pool.tensor.data_ptr()
        assert host_table.pool.data_ptr() == worker.host_pool.tensor.data_ptr()


def test_views_share_the_pools_bytes():
    scheduler, worker = make_pair()
    with worker:
        layers = worker._layers
        device = layers.device_cache(L0)
        assert device.shape == (worker.num_device_blocks, B, layers.row_bytes(
            worker.groups.resident_layer_name[L0], host=False))
        device[1, 2] = 7
        offset = worker.groups.device_tensors[worker.groups.resident_layer_name[L0]].offset
        start = offset + worker.bytes_per_block + 2 * device.shape[2]
        assert worker.device_pool.tensor[start:start + device.shape[2]].eq(7).all()
        host = layers.host_cache(L0)
        assert host.shape == (worker.num_host_blocks, B, layers.row_bytes(L0, host=True))
        host[3, 1] = 9
        offset = worker.groups.host_tensors[L0].offset
        start = offset + (3 * B + 1) * host.shape[2]
        assert worker.host_pool.tensor[start:start + host.shape[2]].eq(9).all()
        assert torch.equal(layers.host_cache(L0 + ".hisparse_hot"), host)


def test_bad_layers_are_named():
    scheduler, worker = make_pair()
    with worker:
        layers = worker._layers
        indexer = next(n for n in scheduler.device_layers if "indexer" in n)
        with pytest.raises(KeyError, match="is not a source"):
            layers.host_cache(indexer)
        with pytest.raises(ValueError, match="not row-aligned"):
            layers.device_rows(L0)
        layers.num_host_blocks += 1          # a tensor that is no longer whole pages
        with pytest.raises(ValueError, match=rf"layer '{L0}': tensor of \d+ B is not"):
            layers.row_bytes(L0, host=True)
