"""HiSparseConfig / EngineConfig validation."""

import pytest

from hisparse_triton.config import (
    ACTIVE_TAIL_PAGES,
    GIB,
    MAX_DEVICE_BUFFER_SIZE,
    MAX_HOST_POOL_GIB,
    EngineConfig,
    HiSparseConfig,
)


def test_defaults():
    config = HiSparseConfig(host_pool_gib=64)
    assert config.index_topk == 2048
    assert config.max_decode_query_len == 1
    assert config.device_buffer_size == 2 * 2048
    assert config.shared_host_pool is None
    assert config.host_pool_bytes == 64 * GIB
    assert HiSparseConfig(host_pool_gib=1, max_decode_query_len=4).device_buffer_size == 5 * 2048
    assert HiSparseConfig(host_pool_gib=1, index_topk=32).device_buffer_size == 64
    assert ACTIVE_TAIL_PAGES == 2 and MAX_DEVICE_BUFFER_SIZE == 32768


def test_host_pool_bytes_rounds_down():
    assert HiSparseConfig(host_pool_gib=0.5).host_pool_bytes == GIB // 2
    assert HiSparseConfig(host_pool_gib=1e-9).host_pool_bytes == 1


def test_device_buffer_size_bounds():
    assert HiSparseConfig(host_pool_gib=1, device_buffer_size=2048).device_buffer_size == 2048
    assert HiSparseConfig(host_pool_gib=1, device_buffer_size=32768).device_buffer_size == 32768
    with pytest.raises(ValueError, match=r"device_buffer_size=2047 is smaller than "
                                         r"max_decode_query_len \* index_topk = 2048"):
        HiSparseConfig(host_pool_gib=1, device_buffer_size=2047)
    with pytest.raises(ValueError, match=r"device_buffer_size=4096 is smaller than "
                                         r"max_decode_query_len \* index_topk = 6144"):
        HiSparseConfig(host_pool_gib=1, device_buffer_size=4096, max_decode_query_len=3)
    with pytest.raises(ValueError, match="device_buffer_size=32769 exceeds the maximum of 32768"):
        HiSparseConfig(host_pool_gib=1, device_buffer_size=32769)
    # the default can exceed the maximum too: (15 + 1) * 4096
    with pytest.raises(ValueError, match=r"device_buffer_size=65536 \(the default, "
                                         r"\(max_decode_query_len \+ 1\) \* index_topk; set "
                                         r"device_buffer_size explicitly\) exceeds the maximum"):
        HiSparseConfig(host_pool_gib=1, index_topk=4096, max_decode_query_len=15)


def test_host_pool_gib_required_and_positive():
    with pytest.raises(ValueError, match="host_pool_gib is required when HiSparse is enabled"):
        HiSparseConfig()
    # inf and 1e300 (inf bytes) used to pass here and fail later in host_pool_bytes with an
    # OverflowError traceback.
    for bad in (0, -1, True, "64", float("nan"), float("inf"), 1e300, 10**12, 2**2000,
                MAX_HOST_POOL_GIB + 1):
        with pytest.raises(ValueError, match=r"host_pool_gib must be a finite number in "
                                             r"\(0, 1048576\] \(GiB\)"):
            HiSparseConfig(host_pool_gib=bad)
    assert HiSparseConfig(host_pool_gib=MAX_HOST_POOL_GIB).host_pool_bytes == 2**50


def test_numpy_numbers_are_accepted_wherever_python_ones_are():
    import numpy as np

    config = EngineConfig(max_model_len=np.int64(64), num_gpu_blocks_override=np.int32(8),
                          tensor_parallel_size=np.uint8(2),
                          hisparse=HiSparseConfig(index_topk=np.int16(8),
                                                  host_pool_gib=np.float32(0.5)))
    assert config.max_model_len == 64 and type(config.max_model_len) is int
    assert type(config.tensor_parallel_size) is int and type(config.hisparse.index_topk) is int
    assert type(config.hisparse.host_pool_gib) is float and config.hisparse.host_pool_bytes
    with pytest.raises(ValueError, match="must be an int >= 1, got True"):
        EngineConfig(max_model_len=True)
    with pytest.raises(ValueError, match="must be an int >= 1, got np.True_|got True"):
        EngineConfig(max_model_len=np.bool_(True))


@pytest.mark.parametrize("field, value", [
    ("index_topk", 0), ("index_topk", 1.5), ("max_decode_query_len", 0),
    ("device_buffer_size", 0), ("device_buffer_size", "4096"),
])
def test_int_fields_rejected(field, value):
    with pytest.raises(ValueError, match=f"HiSparseConfig.{field} must be an int >= 1, "
                                         f"got {value!r}"):
        HiSparseConfig(host_pool_gib=1, **{field: value})


def test_shared_host_pool_flag_type():
    with pytest.raises(ValueError, match="shared_host_pool must be True, False or None"):
        HiSparseConfig(host_pool_gib=1, shared_host_pool=1)


def test_engine_config_validation():
    with pytest.raises(ValueError, match="EngineConfig.max_model_len must be an int >= 1, got 0"):
        EngineConfig(max_model_len=0)
    with pytest.raises(ValueError, match="tensor_parallel_size must be an int >= 1"):
        EngineConfig(max_model_len=10, tensor_parallel_size=0)
    with pytest.raises(ValueError, match="num_gpu_blocks_override must be an int >= 1"):
        EngineConfig(max_model_len=10, num_gpu_blocks_override=0)
    with pytest.raises(TypeError, match="must be a HiSparseConfig or None, got dict"):
        EngineConfig(max_model_len=10, hisparse={"host_pool_gib": 1})


@pytest.mark.parametrize("flag, tp, expected", [
    (None, 1, False), (None, 2, True), (None, 8, True),
    (True, 1, True), (False, 8, False),
])
def test_shared_host_pool_auto(flag, tp, expected):
    hisparse = HiSparseConfig(host_pool_gib=1, shared_host_pool=flag)
    assert EngineConfig(10, hisparse, tensor_parallel_size=tp).shared_host_pool is expected


def test_shared_host_pool_off_without_hisparse():
    assert EngineConfig(10, tensor_parallel_size=8).shared_host_pool is False


@pytest.mark.parametrize("tp, pp, nodes, expected", [
    (8, 1, 1, True), (1, 1, 1, False), (8, 2, 1, False), (8, 1, 2, False), (16, 2, 2, False),
])
def test_shared_host_pool_auto_needs_one_node_and_one_stage(tp, pp, nodes, expected):
    hisparse = HiSparseConfig(host_pool_gib=1)
    config = EngineConfig(10, hisparse, tensor_parallel_size=tp, pipeline_parallel_size=pp,
                          num_nodes=nodes)
    assert config.shared_host_pool is expected


@pytest.mark.parametrize("pp, nodes", [(2, 1), (1, 2), (4, 4)])
def test_explicit_shared_host_pool_across_nodes_or_stages_is_an_error(pp, nodes):
    hisparse = HiSparseConfig(host_pool_gib=1, shared_host_pool=True)
    with pytest.raises(ValueError, match=(
            rf"shared_host_pool=True needs every rank on one node and no pipeline parallelism "
            rf".* but num_nodes={nodes} and pipeline_parallel_size={pp}; leave "
            rf"shared_host_pool unset \(auto\) or False\.")):
        EngineConfig(10, hisparse, tensor_parallel_size=8, pipeline_parallel_size=pp,
                     num_nodes=nodes)
    # explicitly private is always fine
    off = HiSparseConfig(host_pool_gib=1, shared_host_pool=False)
    assert EngineConfig(10, off, tensor_parallel_size=8, pipeline_parallel_size=pp,
                        num_nodes=nodes).shared_host_pool is False


def test_parallel_and_batching_fields_validated():
    for field, value in (("pipeline_parallel_size", 0), ("num_nodes", 0),
                         ("max_num_batched_tokens", 0), ("max_num_batched_tokens", 1.5),
                         ("num_nodes", True), ("max_concurrent_batches", 0),
                         ("max_concurrent_batches", None), ("max_concurrent_batches", 2.0)):
        with pytest.raises(ValueError, match=f"EngineConfig.{field} must be an int >= 1, "
                                             f"got {value!r}"):
            EngineConfig(max_model_len=10, **{field: value})
    config = EngineConfig(max_model_len=10)
    assert (config.pipeline_parallel_size, config.num_nodes) == (1, 1)
    assert config.max_num_batched_tokens is None
    assert config.max_concurrent_batches == 1


def test_in_flight_tokens():
    assert EngineConfig(1000).in_flight_tokens == 1000
    assert EngineConfig(1000, max_num_batched_tokens=256).in_flight_tokens == 256
    assert EngineConfig(1000, max_num_batched_tokens=8192).in_flight_tokens == 1000
    # every batch in flight may hold max_num_batched_tokens (vLLM: 2 with async scheduling)
    assert EngineConfig(1000, max_num_batched_tokens=256,
                        max_concurrent_batches=2).in_flight_tokens == 512
    assert EngineConfig(1000, max_num_batched_tokens=256,
                        max_concurrent_batches=4).in_flight_tokens == 1000
