"""``_C_cache_ops::cp_gather_and_upconvert_fp8_kv_cache`` with and without host rows: our
torch model of vLLM 0.33's semantics against a scalar decode written from the fp8_ds_mla
format, and the Triton kernel against the model, bit for bit (bf16 bit patterns).

Rules from vLLM 0.33.0: ``vllm/_custom_ops.py`` (the wrapper's docstring),
``csrc/cache_kernels.cu`` (``cp_gather_and_upconvert_fp8_kv_cache``: the page-task mapping of
workspace rows to requests, e4m3 times the 128-value tile's fp32 scale, rope copied), and the
prefill staging call in ``vllm/v1/attention/backends/mla/index_group.py``
(``HiSparseMLAIndexGroup.gather_fp8_prefill``: a remapped block table whose staged rows name
a device row, or else a host row); vLLM is not needed here.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hisparse_triton.integrations import vllm_reference
from vllm_op_cases import naive_upconvert, naive_upconvert_row, random_fp8_rows


def _kernel():
    from hisparse_triton.kernels import vllm_fp8

    return vllm_fp8.cp_gather_and_upconvert_fp8_kv_cache


def test_row_decode_matches_the_format():
    rng = np.random.default_rng(0)
    rows = random_fp8_rows(rng, 4)
    rows[0, :8] = [0x00, 0x80, 0x01, 0x81, 0x07, 0x08, 0x7E, 0xFE]  # +-0, subnormals, max
    rows[1, :2] = [0x7F, 0xFF]                                       # NaN -> 0x7FFF
    want = np.array([naive_upconvert_row(bytes(r)) for r in rows]).astype(np.uint16)
    got = vllm_reference.upconvert_fp8_rows(torch.from_numpy(rows)).numpy().view(np.uint16)
    np.testing.assert_array_equal(got, want)
    assert got[1, 0] == got[1, 1] == 0x7FFF and got[0, 1] == 0x8000


def paged_case(rng, *, blocks=6, B=4, batch=3, width=4, T=20):
    cache = random_fp8_rows(rng, blocks * B).reshape(blocks, B, 656)
    table = rng.integers(-1, blocks + 2, size=(batch + 1, width)).astype(np.int32)
    starts = np.sort(rng.integers(0, T, size=batch)).astype(np.int32)
    starts[0] = 1                                  # row 0 belongs to no request
    seq_starts = rng.integers(-1, 6, size=batch).astype(np.int32)
    return cache, table, starts, seq_starts, T


def run(op, cache, table, starts, batch, seq_starts, T, device="cpu", host_cache=None,
        host_row_ids=None, device_row_ids=None) -> np.ndarray:
    """Call ``op`` in vLLM's argument order; the workspace starts as 3.0 everywhere (rows no
    request owns keep it); returns its bf16 bit patterns."""
    def to(a):
        return None if a is None else torch.from_numpy(np.ascontiguousarray(a)).to(device)

    host = None
    if host_cache is not None:
        host = torch.from_numpy(host_cache)
        host = host.pin_memory() if device != "cpu" else host
    dst = torch.full((T, 576), 3.0, dtype=torch.bfloat16, device=device)
    op(to(cache), dst, to(table), to(starts), batch, to(seq_starts), host, to(host_row_ids),
       to(device_row_ids))
    return dst.view(torch.int16).cpu().numpy().view(np.uint16)


@pytest.mark.parametrize("with_seq_starts", [False, True])
def test_paged_torch_model_matches_scalar_walk(with_seq_starts):
    rng = np.random.default_rng(1)
    cache, table, starts, seq, T = paged_case(rng)
    seq = seq if with_seq_starts else None
    want = np.full((T, 576), np.float32(3.0).view(np.uint32) >> 16, np.uint16)
    naive_upconvert(cache, want, table, starts, 3, seq)
    got = run(vllm_reference.cp_gather_and_upconvert_fp8_kv_cache, cache, table, starts, 3, seq,
              T)
    np.testing.assert_array_equal(got, want)


def staging_case(rng, *, B=4, staged_blocks=5, device_blocks=6, host_rows=30, batch=2):
    cache, _, starts, _, T = paged_case(rng, blocks=device_blocks, B=B, batch=batch)
    host = random_fp8_rows(rng, host_rows)
    table = rng.integers(-1, staged_blocks + 1, size=(batch, 3)).astype(np.int32)
    n = staged_blocks * B
    host_ids = rng.integers(-1, host_rows + 3, size=(1, n)).astype(np.int32)
    device_ids = np.where(rng.random((1, n)) < 0.4,
                          rng.integers(-1, device_blocks * B + 2, size=(1, n)), -1).astype(
                              np.int32)
    return cache, table, starts, T, host, host_ids, device_ids


@pytest.mark.parametrize("with_device_rows", [False, True])
def test_staging_torch_model_matches_scalar_walk(with_device_rows):
    rng = np.random.default_rng(2)
    cache, table, starts, T, host, host_ids, device_ids = staging_case(rng)
    device_ids = device_ids if with_device_rows else None
    want = np.full((T, 576), np.float32(3.0).view(np.uint32) >> 16, np.uint16)
    naive_upconvert(cache, want, table, starts, 2, None, host, host_ids, device_ids)
    got = run(vllm_reference.cp_gather_and_upconvert_fp8_kv_cache, cache, table, starts, 2,
              None, T, host_cache=host, host_row_ids=host_ids, device_row_ids=device_ids)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("with_seq_starts", [False, True])
def test_paged_kernel_matches_torch_model(kernel_device, with_seq_starts):
    rng = np.random.default_rng(3)
    cache, table, starts, seq, T = paged_case(rng, batch=3, T=37)
    seq = seq if with_seq_starts else None
    want = run(vllm_reference.cp_gather_and_upconvert_fp8_kv_cache, cache, table, starts, 3, seq,
               T)
    got = run(_kernel(), cache, table, starts, 3, seq, T, kernel_device.type)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("with_device_rows", [False, True])
def test_staging_kernel_matches_torch_model(kernel_device, with_device_rows):
    rng = np.random.default_rng(4)
    cache, table, starts, T, host, host_ids, device_ids = staging_case(rng)
    kw = dict(host_cache=host, host_row_ids=host_ids,
              device_row_ids=device_ids if with_device_rows else None)
    want = run(vllm_reference.cp_gather_and_upconvert_fp8_kv_cache, cache, table, starts, 2,
               None, T, **kw)
    got = run(_kernel(), cache, table, starts, 2, None, T, kernel_device.type, **kw)
    np.testing.assert_array_equal(got, want)


def test_unsorted_workspace_starts_later_request_wins(kernel_device):
    """Overlapping request ranges (not a layout vLLM builds): the later request's rows."""
    rng = np.random.default_rng(5)
    cache, table, _, _, T = paged_case(rng, batch=3, T=12)
    starts = np.array([0, 6, 3], np.int32)
    want = np.zeros((T, 576), np.uint16)
    naive_upconvert(cache, want, table, starts, 3)
    args = (cache, table, starts, 3, None, T)
    ref = run(vllm_reference.cp_gather_and_upconvert_fp8_kv_cache, *args)
    np.testing.assert_array_equal(ref[:6], want[:6])
    np.testing.assert_array_equal(run(_kernel(), *args, kernel_device.type), ref)


def test_bad_arguments_raise():
    rng = np.random.default_rng(6)
    cache, table, starts, _, T = paged_case(rng)
    dst = torch.zeros(T, 512, dtype=torch.bfloat16)
    for op in (vllm_reference.cp_gather_and_upconvert_fp8_kv_cache, _kernel()):
        with pytest.raises(RuntimeError, match="576"):
            op(torch.from_numpy(cache), dst, torch.from_numpy(table), torch.from_numpy(starts),
               3, None)
        with pytest.raises(RuntimeError, match="batch_size"):
            op(torch.from_numpy(cache), torch.zeros(T, 576, dtype=torch.bfloat16),
               torch.from_numpy(table), torch.from_numpy(starts), 9, None)
        with pytest.raises(RuntimeError, match="together"):
            op(torch.from_numpy(cache), torch.zeros(T, 576, dtype=torch.bfloat16),
               torch.from_numpy(table), torch.from_numpy(starts), 3, None,
               torch.zeros(4, 656, dtype=torch.uint8), None)
