"""``_C_cache_ops::hisparse_gather_plan`` and ``hisparse_gather_compact``: our torch models of
vLLM 0.33's semantics against a scalar walk of vLLM's kernels, and the Triton kernel against
the torch models, byte for byte over the whole destination backing (canary bytes between
blocks and after the cache catch any stray write).

Rules from vLLM 0.33.0's ``csrc/hisparse_kernels.cu`` (``hisparse_gather_plan_kernel``,
``hisparse_gather_compact_kernel``) and their call sites in ``vllm/v1/hisparse/runtime.py``
(``HiSparseRuntime._swap_rows``, ``gather_prefill_cache``); vLLM is not needed here.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hisparse_triton.integrations import vllm_reference
from vllm_op_cases import POISON, naive_gather_compact, naive_gather_plan


def _kernels():
    from hisparse_triton.kernels import vllm_gather

    return vllm_gather


class Caches:
    """A host cache ``[host_rows, row_bytes]`` and a hot cache view into a byte backing: paged
    ``[blocks, hbs, row]`` with ``block_stride`` bytes from block to block (layers of other
    groups interleaved, as vLLM's shared slab), or a 2-D staging buffer (``hbs=0``)."""

    def __init__(self, rng, *, host_rows=24, blocks=6, hbs=4, row_bytes=656, gap=48,
                 dtype=torch.uint8):
        self.rng, self.hbs, self.row_bytes = rng, max(hbs, 1), row_bytes
        self.host = torch.from_numpy(rng.integers(0, 256, size=(host_rows, row_bytes),
                                                  dtype=np.uint8)).view(dtype)
        itemsize = torch.empty(0, dtype=dtype).element_size()
        width = row_bytes // itemsize
        self.block_stride = hbs * row_bytes + gap if hbs else row_bytes
        self.hot_rows = blocks * hbs if hbs else blocks
        size = blocks * self.block_stride + 64
        self.backing = torch.from_numpy(rng.integers(0, 256, size=size, dtype=np.uint8))
        if hbs:
            self.shape = (blocks, hbs, width)
            self.strides = (self.block_stride // itemsize, width, 1)
        else:
            self.shape, self.strides = (blocks, width), (width, 1)
        self.dtype = dtype
        self.hot = self._view(self.backing)

    def _view(self, backing: torch.Tensor) -> torch.Tensor:
        """The hot cache as a strided view of ``backing`` (any device)."""
        itemsize = torch.empty(0, dtype=self.dtype).element_size()
        typed = backing[:backing.numel() - backing.numel() % itemsize].view(self.dtype)
        return typed.as_strided(self.shape, self.strides)

    def to(self, device="cpu") -> "Caches":
        """A copy (backing and hot view) on ``device``; the host cache is shared."""
        other = object.__new__(Caches)
        other.__dict__.update(self.__dict__)
        other.backing = self.backing.clone().to(device)
        other.hot = other._view(other.backing)
        return other

    def clone(self) -> "Caches":
        return self.to("cpu")


def distinct_destinations(rng, R, K, hot_rows):
    """Destinations unique over the plan (vLLM's resolver never repeats one), with -1 and
    out-of-range rows mixed in."""
    flat = rng.permutation(hot_rows + 4)[:R * K] - 2
    flat = np.concatenate([flat, np.full(max(0, R * K - flat.size), -1)])[:R * K]
    return flat.reshape(R, K).astype(np.int32)


def plan_case(rng, caches: Caches, R=3, K=8):
    host_rows = caches.host.shape[0]
    g = rng.integers(-2, host_rows + 4, size=(R, K)).astype(np.int32)  # < 0 and past the host
    dst = distinct_destinations(rng, R, K, caches.hot_rows)
    mask = rng.integers(0, 3, size=(R, K)).astype(np.int32)            # any non-zero selects
    rsi = np.arange(R, dtype=np.int32)
    rsi[1] = -1                                                         # a padding row
    return g, dst, mask, rsi


def _t(a, device="cpu"):
    return torch.from_numpy(np.ascontiguousarray(a)).to(device)


@pytest.mark.parametrize("layout", ["paged", "staging"])
@pytest.mark.parametrize("row_bytes", [16, 656])
def test_plan_torch_model_matches_scalar_walk(layout, row_bytes):
    rng = np.random.default_rng(row_bytes)
    caches = Caches(rng, row_bytes=row_bytes, hbs=4 if layout == "paged" else 0)
    g, dst, mask, rsi = plan_case(rng, caches)
    want = caches.backing.numpy().copy()
    stride = 12
    want_attn = naive_gather_plan(caches.host.view(torch.uint8).numpy(), want, g, dst, mask, rsi,
                                  caches.hbs, caches.block_stride, caches.hot_rows, stride)
    attn = torch.full(g.shape, POISON, dtype=torch.int32)
    vllm_reference.hisparse_gather_plan(caches.host, caches.hot, _t(g), _t(dst), _t(mask),
                                        _t(rsi), attn, stride)
    np.testing.assert_array_equal(caches.backing.numpy(), want)
    np.testing.assert_array_equal(attn.numpy(), want_attn)


def test_plan_without_state_indices_or_attention():
    rng = np.random.default_rng(3)
    caches = Caches(rng)
    g, dst, mask, _ = plan_case(rng, caches)
    want = caches.backing.numpy().copy()
    naive_gather_plan(caches.host.numpy(), want, g, dst, mask, None, caches.hbs,
                      caches.block_stride, caches.hot_rows, 4)
    vllm_reference.hisparse_gather_plan(caches.host, caches.hot, _t(g), _t(dst), _t(mask), None,
                                        None, 0)
    np.testing.assert_array_equal(caches.backing.numpy(), want)


def test_compact_torch_model_matches_scalar_walk():
    rng = np.random.default_rng(5)
    caches = Caches(rng, blocks=8)
    R, K = 4, 8
    g = rng.integers(-2, caches.host.shape[0] + 4, size=(R, K)).astype(np.int32)
    dst = distinct_destinations(rng, R, K, caches.hot_rows)
    counts = np.array([0, K // 2, K + 5, -3], np.int32)  # none, some, clamp to K, negative
    want = caches.backing.numpy().copy()
    naive_gather_compact(caches.host.numpy(), want, g, dst, counts, caches.hbs,
                         caches.block_stride, caches.hot_rows)
    vllm_reference.hisparse_gather_compact(caches.host, caches.hot, _t(g), _t(dst), _t(counts))
    np.testing.assert_array_equal(caches.backing.numpy(), want)


@pytest.mark.parametrize("layout,row_bytes,dtype", [
    ("paged", 656, torch.uint8), ("paged", 16, torch.uint8), ("staging", 656, torch.uint8),
    ("paged", 1152, torch.bfloat16), ("paged", 144, torch.uint8)])
def test_plan_kernel_matches_torch_model(kernel_device, layout, row_bytes, dtype):
    rng = np.random.default_rng(row_bytes + 1)
    caches = Caches(rng, row_bytes=row_bytes, hbs=4 if layout == "paged" else 0,
                    gap=40 if row_bytes % 16 else 48, dtype=dtype)
    g, dst, mask, rsi = plan_case(rng, caches, R=3, K=16)
    want = caches.clone()
    want_attn = torch.full(g.shape, POISON, dtype=torch.int32)
    vllm_reference.hisparse_gather_plan(want.host, want.hot, _t(g), _t(dst), _t(mask), _t(rsi),
                                        want_attn, 9)
    got = caches.to(kernel_device)
    attn = torch.full(g.shape, POISON, dtype=torch.int32, device=kernel_device)
    host = caches.host.pin_memory() if kernel_device.type == "cuda" else caches.host
    _kernels().hisparse_gather_plan(host, got.hot, _t(g, kernel_device),
                                    _t(dst, kernel_device), _t(mask, kernel_device),
                                    _t(rsi, kernel_device), attn, 9)
    assert torch.equal(got.backing.cpu(), want.backing)
    assert torch.equal(attn.cpu(), want_attn)


@pytest.mark.parametrize("row_bytes", [16, 656])
def test_compact_kernel_matches_torch_model(kernel_device, row_bytes):
    rng = np.random.default_rng(row_bytes + 2)
    caches = Caches(rng, blocks=12, row_bytes=row_bytes)
    R, K = 5, 12
    g = rng.integers(-2, caches.host.shape[0] + 4, size=(R, K)).astype(np.int32)
    dst = distinct_destinations(rng, R, K, caches.hot_rows)
    counts = np.array([0, 5, K + 5, -3, K], np.int32)
    want = caches.clone()
    vllm_reference.hisparse_gather_compact(want.host, want.hot, _t(g), _t(dst), _t(counts))
    got = caches.to(kernel_device)
    host = caches.host.pin_memory() if kernel_device.type == "cuda" else caches.host
    _kernels().hisparse_gather_compact(host, got.hot, _t(g, kernel_device),
                                       _t(dst, kernel_device), _t(counts, kernel_device))
    assert torch.equal(got.backing.cpu(), want.backing)


def test_resolve_plan_then_compact_gather_fills_the_slots():
    """The resolver's compact plan, replayed by the compact gather and by the per-layer plan
    gather (a follower layer), loads the same rows into the same slots."""
    from vllm_op_cases import random_resolve_case, resolve_args

    rng = np.random.default_rng(9)
    case = random_resolve_case(rng, rows_per_request=[2, 1], top_k=8, hot_size=16)
    args, outs = resolve_args(case)
    vllm_reference.hisparse_resolve_residency(*args)
    blocks = case.hot_num_blocks
    caches = Caches(rng, host_rows=case.host_rows, blocks=blocks, hbs=case.hot_block_size)
    leader, follower = caches.clone(), caches.clone()
    vllm_reference.hisparse_gather_compact(leader.host, leader.hot, outs["swap_host"],
                                           outs["swap_dev"], outs["swap_counts"])
    vllm_reference.hisparse_gather_plan(follower.host, follower.hot, outs["resolved"],
                                        outs["hot"], outs["miss"], None, None, 0)
    assert torch.equal(leader.backing, follower.backing)
    loaded = outs["swap_counts"].sum().item()
    assert loaded > 0 and not torch.equal(leader.backing, caches.backing)


@pytest.mark.parametrize("op", ["plan", "compact"])
def test_bad_arguments_raise_and_change_nothing(op):
    rng = np.random.default_rng(1)
    caches = Caches(rng)
    g, dst, mask, rsi = plan_case(rng, caches)
    before = caches.backing.clone()
    for impl in (vllm_reference, _kernels()):
        with pytest.raises(RuntimeError, match="row"):
            bad_host = caches.host[:, :16].contiguous()
            if op == "plan":
                impl.hisparse_gather_plan(bad_host, caches.hot, _t(g), _t(dst), _t(mask),
                                          _t(rsi), None, 0)
            else:
                impl.hisparse_gather_compact(bad_host, caches.hot, _t(g), _t(dst),
                                             _t(np.zeros(3, np.int32)))
        with pytest.raises(RuntimeError, match="shape"):
            if op == "plan":
                impl.hisparse_gather_plan(caches.host, caches.hot, _t(g), _t(dst[:, :4]),
                                          _t(mask), _t(rsi), None, 0)
            else:
                impl.hisparse_gather_compact(caches.host, caches.hot, _t(g), _t(dst[:, :4]),
                                             _t(np.zeros(3, np.int32)))
    assert torch.equal(caches.backing, before)
