"""vLLM 0.33's row gathers in vLLM's own form: ``hisparse_gather_plan`` (replay a layer's miss
plan, or stage prefill rows) and ``hisparse_gather_compact`` (the resolve's compact plan).

Semantics: ``hisparse_triton.integrations.vllm_reference`` (matched bit for bit). Both are
launches of one kernel, ``_gather_rows_kernel``: a *work item* is ``COLS`` consecutive plan
columns of one plan row, numbered column-chunk-major (the first columns of every row, where
compact plans hold their misses, spread over all programs); the grid is capped at
``GRID_PROGRAMS_PER_SM`` programs per SM (the copy kernels' rule) and walks the items
grid-stride, so its parallelism never depends on the batch size. A compact item whose first
column is past its row's count exits after one load. Rows move as ``CHUNK`` words per step
(int32 words, 16-byte accesses when every address is 16-byte aligned); a source row at or
past the host rows zero-fills its destination; ``g < 0`` or a destination outside the hot
cache is skipped. The host cache is pinned CPU memory on CUDA (checked once per tensor) and
is read through unified addressing. The launchers read no tensor values: CUDA-graph safe.

A shared copy kernel could serve ``hisparse_gather_compact`` if it had a flag for "a negative
source id skips" (``kernels/gather.py``'s zero-fills): vLLM skips, so this one does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hisparse_triton.integrations.vllm_checks import (
    check_gather_compact,
    check_gather_plan,
    checked,
)
from hisparse_triton.kernels.gather import (
    GRID_PROGRAMS_PER_SM,
    device_guard,
    sm_count,
)
from hisparse_triton.kernels import vllm_residency
from hisparse_triton.kernels.masks import _lanes

__all__ = ["hisparse_gather_compact", "hisparse_gather_plan"]

_COLS = 8
_CHUNK_WORDS = 64


@triton.jit
def _gather_rows_kernel(
    host_ptr, hot_ptr, src_ptr, dst_ptr, mask_ptr, rsi_ptr, counts_ptr, attn_ptr,
    R, K, num_items, host_rows, hot_rows, hot_block_words, row_words, abs_stride,
    HBS: tl.constexpr, COLS: tl.constexpr, CHUNK: tl.constexpr, VEC: tl.constexpr,
    PLAN: tl.constexpr, HAS_RSI: tl.constexpr, HAS_ATTN: tl.constexpr,
):
    """Copy host row ``src[r, c]`` to hot row ``dst[r, c]`` for the selected columns: PLAN:
    ``mask[r, c] != 0`` on non-padding rows (and write ``attn``); else ``c < counts[r]``."""
    col_offs = tl.arange(0, COLS)
    word_offs = tl.arange(0, CHUNK)
    for item in range(tl.program_id(0), num_items, tl.num_programs(0)):
        row = (item % R).to(tl.int64)
        c = (item // R) * COLS + col_offs
        cm = c < K
        at = row * K + c
        if PLAN:
            padding = row < 0
            if HAS_RSI:
                padding = tl.load(rsi_ptr + row) < 0
            pad = _lanes(padding, c)
            dst = tl.load(dst_ptr + at, mask=cm, other=-1)
            if HAS_ATTN:
                attention = tl.where(dst < 0, -1, (dst // HBS) * abs_stride + dst % HBS)
                tl.store(attn_ptr + at, tl.where(pad, -1, attention), mask=cm)
            sel = tl.load(mask_ptr + at, mask=cm, other=0)
            live = cm & (sel != 0) & ~pad
        else:
            count = tl.minimum(tl.maximum(tl.load(counts_ptr + row), 0), K)
            live = cm & (c < count)
            dst = tl.load(dst_ptr + at, mask=live, other=-1)
        g = tl.load(src_ptr + at, mask=live, other=-1).to(tl.int64)
        d = dst.to(tl.int64)
        ok = live & (g >= 0) & (d >= 0) & (d < hot_rows)
        have = ok & (g < host_rows)
        src_word = tl.multiple_of(tl.where(have, g, 0) * row_words, VEC)
        dc = tl.where(ok, d, 0)
        dst_word = tl.multiple_of((dc // HBS) * hot_block_words + (dc % HBS) * row_words, VEC)
        for w0 in range(0, row_words, CHUNK):
            w = w0 + word_offs
            wm = (w < row_words)[None, :]
            vals = tl.load(host_ptr + src_word[:, None] + w[None, :], mask=have[:, None] & wm,
                           other=0, cache_modifier=".cg")
            tl.store(hot_ptr + dst_word[:, None] + w[None, :], vals, mask=ok[:, None] & wm)


def _launch(host_cache, hot_cache, src, dst, mask, rsi, counts, attn, R: int, K: int,
            hbs: int, hot_rows: int, host_rows: int, row_bytes: int, abs_stride: int,
            plan: bool) -> None:
    device = src.device
    if device.type == "cuda":
        vllm_residency._check_host_cache(
            "hisparse_gather_plan" if plan else "hisparse_gather_compact", host_cache, device)
    else:
        vllm_residency._check_backend(device)
    block_bytes = hot_cache.stride(0) * hot_cache.element_size()
    word = 4 if block_bytes % 4 == 0 and hot_cache.data_ptr() % 4 == 0 \
        and host_cache.data_ptr() % 4 == 0 else 1
    vec = 4 if word == 4 and block_bytes % 16 == 0 and hot_cache.data_ptr() % 16 == 0 \
        and host_cache.data_ptr() % 16 == 0 else 1
    dtype = torch.int32 if word == 4 else torch.uint8
    items = R * -(-K // _COLS)
    programs = GRID_PROGRAMS_PER_SM * sm_count(device)
    with device_guard(src):
        _gather_rows_kernel[(max(1, min(items, programs)),)](
            host_cache.view(dtype), hot_cache.view(dtype), src, dst,
            mask if mask is not None else src, rsi if rsi is not None else src,
            counts if counts is not None else src, attn if attn is not None else src,
            R, K, items, host_rows, hot_rows, block_bytes // word, row_bytes // word,
            abs_stride, HBS=hbs, COLS=_COLS, CHUNK=min(_CHUNK_WORDS, 1 << max(
                0, (row_bytes // word - 1).bit_length())), VEC=vec, PLAN=plan,
            HAS_RSI=rsi is not None, HAS_ATTN=attn is not None, num_warps=4)


def hisparse_gather_plan(host_cache, hot_cache, global_indices, hot_indices, miss_mask,
                         request_state_indices, attention_indices=None,
                         attention_block_stride: int = 0) -> None:
    """Triton ``hisparse_gather_plan`` (vLLM's argument order): one launch."""
    R, K, hbs, hot_rows, host_rows, row_bytes = checked(check_gather_plan, (
        host_cache, hot_cache, global_indices, hot_indices, miss_mask, request_state_indices,
        attention_indices, attention_block_stride))
    if R == 0 or K == 0:
        return
    _launch(host_cache, hot_cache, global_indices, hot_indices, miss_mask,
            request_state_indices, None, attention_indices, R, K, hbs, hot_rows, host_rows,
            row_bytes, attention_block_stride, plan=True)


def hisparse_gather_compact(host_cache, hot_cache, miss_global_indices, miss_hot_indices,
                            miss_counts) -> None:
    """Triton ``hisparse_gather_compact`` (vLLM's argument order): one launch."""
    R, K, hbs, hot_rows, host_rows, row_bytes = checked(check_gather_compact, (
        host_cache, hot_cache, miss_global_indices, miss_hot_indices, miss_counts))
    if R == 0 or K == 0:
        return
    _launch(host_cache, hot_cache, miss_global_indices, miss_hot_indices, None, None,
            miss_counts, None, R, K, hbs, hot_rows, host_rows, row_bytes, 0, plan=False)
