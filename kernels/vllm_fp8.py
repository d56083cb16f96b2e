"""vLLM 0.33's ``cp_gather_and_upconvert_fp8_kv_cache``, host-row form included: gather
fp8_ds_mla rows (656 B: 512 e4m3 values, 4 fp32 scales, 64 bf16 rope values) into a bf16
workspace ``[T, 576]``.

Semantics: ``hisparse_triton.integrations.vllm_reference.cp_gather_and_upconvert_fp8_kv_cache``
(matched bit for bit). Grid ``cdiv(T, TOKENS)``: a program takes ``TOKENS`` workspace rows,
finds the request that owns each (a scan of ``workspace_starts`` in blocks: the last request
whose range holds the row), its source position and block, and the source row: the device
cache, or, on the staging path, the device row or else the pinned host row the staged block
maps to. The e4m3 bytes are decoded with integer operations (exact on every GPU and in the
interpreter: no fp8 hardware conversion needed), scaled in fp32, and rounded to bf16 to
nearest even (NaN -> 0x7FFF); rope values are copied. A row without a valid source is zeroed.
The launcher reads no tensor values: CUDA-graph safe.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from hisparse_triton.integrations.vllm_checks import (
    check_upconvert,
    check_upconvert_addresses,
    checked,
)
from hisparse_triton.kernels.gather import device_guard
from hisparse_triton.kernels.launch_config import KernelLaunch
from hisparse_triton.kernels import vllm_residency

__all__ = ["cp_gather_and_upconvert_fp8_kv_cache", "upconvert_launch"]

_TOKENS = 16
_BLOCK_B = 64


@triton.jit
def _e4m3_to_f32(b):
    """fp8 e4m3fn bytes (int32 in [0, 256)) -> float32, exactly."""
    sign = b >> 7
    exp = (b >> 3) & 15
    man = b & 7
    normal = ((sign << 31) | ((exp + 120) << 23) | (man << 20)).to(tl.float32, bitcast=True)
    sub = man.to(tl.float32) * 0.001953125  # exact; the sign goes in as a bit (keeps -0.0)
    sub = (sub.to(tl.int32, bitcast=True) | (sign << 31)).to(tl.float32, bitcast=True)
    value = tl.where(exp == 0, sub, normal)
    return tl.where((exp == 15) & (man == 7), float("nan"), value)


@triton.jit
def _f32_to_bf16_bits(x):
    """float32 -> bf16 bits (round to nearest even; NaN -> 0x7FFF) as int16."""
    u = x.to(tl.uint32, bitcast=True)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    bits = tl.where(nan, 0x7FFF, rounded.to(tl.int32, bitcast=True))
    return tl.where(bits >= 32768, bits - 65536, bits).to(tl.int16)


@triton.jit
def _either(dev_ptrs, host_ptrs, on_dev, on_host, HAS_HOST: tl.constexpr):
    """The values (ints) at ``dev_ptrs`` where ``on_dev``, at ``host_ptrs`` where ``on_host``
    (never both), else 0: one masked load per source, OR-ed (a masked-off lane reads nothing
    and gives 0). No pointer select: AMD's pointer canonicalisation cannot follow a select
    between two tensors' pointers."""
    value = tl.load(dev_ptrs, mask=on_dev, other=0)
    if HAS_HOST:
        value = value | tl.load(host_ptrs, mask=on_host, other=0)
    return value


@triton.jit
def _upconvert_kernel(
    src8_ptr, src16_ptr, src32_ptr, host8_ptr, host16_ptr, host32_ptr, dst_ptr,
    bt_ptr, stride_bt, table_width, ws_ptr, seq_ptr, hri_ptr, dri_ptr,
    T, batch, cache_rows, host_rows, num_mapped, block_bytes, row_bytes, dst_stride,
    B: tl.constexpr, TOKENS: tl.constexpr, BLOCK_B: tl.constexpr, HAS_SEQ: tl.constexpr,
    HAS_HOST: tl.constexpr, HAS_DEV: tl.constexpr,
):
    t = tl.program_id(0) * TOKENS + tl.arange(0, TOKENS)
    tm = t < T
    # The owning request of each row: the last q with lo_q <= t < hi_q.
    owner = tl.full([TOKENS], -1, tl.int32)
    qb = tl.arange(0, BLOCK_B)
    for q0 in range(0, batch, BLOCK_B):
        q = q0 + qb
        qm = q < batch
        lo = tl.maximum(tl.minimum(tl.load(ws_ptr + q, mask=qm, other=0), T), 0)
        hi = tl.minimum(tl.load(ws_ptr + q + 1, mask=q + 1 < batch, other=T), T)
        cover = qm[None, :] & (t[:, None] >= lo[None, :]) & (t[:, None] < hi[None, :])
        owner = tl.maximum(owner, tl.max(tl.where(cover, q[None, :], -1), axis=1))
    own = tm & (owner >= 0)
    qo = tl.where(own, owner, 0)
    first = tl.minimum(tl.load(ws_ptr + qo, mask=own, other=0), T).to(tl.int64)
    s = t.to(tl.int64) - first
    if HAS_SEQ:
        s += tl.load(seq_ptr + qo, mask=own, other=0).to(tl.int64)
    page = tl.where(s >= 0, s // B, -1)
    ok = own & (s >= 0) & (page < table_width)
    blk = tl.load(bt_ptr + qo.to(tl.int64) * stride_bt + tl.where(ok, page, 0), mask=ok,
                  other=-1).to(tl.int64)
    off = tl.where(s >= 0, s % B, 0)
    if HAS_HOST:
        mapped = tl.where(ok & (blk >= 0), blk * B + off, -1)
        have = (mapped >= 0) & (mapped < num_mapped)
        mi = tl.where(have, mapped, 0)
        host_row = tl.load(hri_ptr + mi, mask=have, other=-1).to(tl.int64)
        if HAS_DEV:
            dev_row = tl.load(dri_ptr + mi, mask=have, other=-1).to(tl.int64)
        else:
            dev_row = host_row * 0 - 1
    else:
        dev_row = tl.where(ok & (blk >= 0), blk * B + off, -1)
        host_row = dev_row * 0 - 1
    on_dev = (dev_row >= 0) & (dev_row < cache_rows)
    on_host = ~on_dev & (host_row >= 0) & (host_row < host_rows)
    found = on_dev | on_host
    dr = tl.where(on_dev, dev_row, 0)
    dev_base = (dr // B) * block_bytes + (dr % B) * row_bytes
    host_base = tl.where(on_host, host_row, 0) * 656
    # 512 e4m3 values, the fp32 scale of each one's 128-value tile, 64 bf16 rope values.
    i = tl.arange(0, 512)
    rw = tl.arange(0, 64)
    nope = _either(src8_ptr + dev_base[:, None] + i[None, :],
                   host8_ptr + host_base[:, None] + i[None, :], on_dev[:, None],
                   on_host[:, None], HAS_HOST).to(tl.int32)
    sw = _either(src32_ptr + ((dev_base + 512) // 4)[:, None] + i[None, :] // 128,
                 host32_ptr + ((host_base + 512) // 4)[:, None] + i[None, :] // 128,
                 on_dev[:, None], on_host[:, None], HAS_HOST)
    rope = _either(src16_ptr + ((dev_base + 528) // 2)[:, None] + rw[None, :],
                   host16_ptr + ((host_base + 528) // 2)[:, None] + rw[None, :],
                   on_dev[:, None], on_host[:, None], HAS_HOST)
    scale = sw.to(tl.float32, bitcast=True)
    bits = tl.where(found[:, None], _f32_to_bf16_bits(_e4m3_to_f32(nope & 255) * scale), 0)
    out = dst_ptr + t.to(tl.int64)[:, None] * dst_stride
    tl.store(out + i[None, :], bits, mask=own[:, None])
    tl.store(out + 512 + rw[None, :], rope, mask=own[:, None])


def cp_gather_and_upconvert_fp8_kv_cache(src_cache, dst, block_table, workspace_starts,
                                         batch_size: int, seq_starts=None, host_cache=None,
                                         host_row_ids=None, device_row_ids=None) -> None:
    """Triton ``cp_gather_and_upconvert_fp8_kv_cache`` (vLLM's argument order): one launch."""
    launch = upconvert_launch(src_cache, dst, block_table, workspace_starts, batch_size,
                              seq_starts, host_cache, host_row_ids, device_row_ids)
    if launch is None:
        return
    if dst.device.type == "cuda":
        if host_cache is not None:
            vllm_residency._check_host_cache("cp_gather_and_upconvert_fp8_kv_cache",
                                             host_cache, dst.device)
    else:
        vllm_residency._check_backend(dst.device)
    with device_guard(dst):
        launch()


def upconvert_launch(src_cache, dst, block_table, workspace_starts, batch_size: int,
                     seq_starts=None, host_cache=None, host_row_ids=None,
                     device_row_ids=None) -> Optional[KernelLaunch]:
    """The launch ``cp_gather_and_upconvert_fp8_kv_cache`` makes for these arguments (checked
    as it checks them), without making it; None when there is nothing to copy."""
    T, batch, B, cache_rows, host_rows, num_mapped = checked(check_upconvert, (
        src_cache, dst, block_table, workspace_starts, batch_size, seq_starts, host_cache,
        host_row_ids, device_row_ids))
    check_upconvert_addresses(src_cache, dst)
    if T == 0 or batch == 0:
        return None
    src8 = src_cache.view(torch.uint8)
    host8 = host_cache.view(torch.uint8) if host_cache is not None else src8
    args = (src8, src8.view(torch.int16), src8.view(torch.int32), host8,
            host8.view(torch.int16), host8.view(torch.int32), dst.view(torch.int16),
            block_table, block_table.stride(0), block_table.shape[1], workspace_starts,
            seq_starts if seq_starts is not None else workspace_starts,
            host_row_ids if host_row_ids is not None else workspace_starts,
            device_row_ids if device_row_ids is not None else workspace_starts,
            T, batch, cache_rows, host_rows, num_mapped, src8.stride(0), src8.stride(1),
            dst.stride(0))
    kwargs = dict(B=B, TOKENS=_TOKENS, BLOCK_B=_BLOCK_B, HAS_SEQ=seq_starts is not None,
                  HAS_HOST=host_cache is not None, HAS_DEV=device_row_ids is not None,
                  num_warps=4)
    return KernelLaunch(_upconvert_kernel, (-(-T // _TOKENS),), args, kwargs)
