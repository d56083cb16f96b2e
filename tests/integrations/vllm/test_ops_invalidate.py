"""``_C_cache_ops::hisparse_invalidate_written_slots``: our torch model of vLLM 0.33's
semantics against a scalar walk of vLLM's kernel, and the Triton kernel against the model.

Rules from vLLM 0.33.0's ``csrc/hisparse_kernels.cu``
(``hisparse_invalidate_written_slots_kernel``) and its call site
``vllm/v1/hisparse/runtime.py`` (``HiSparseRuntime.invalidate_written_slots``: the host
rows mirrored this step lose their stale hot copies); vLLM is not needed here.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hisparse_triton.integrations import vllm_reference
from vllm_op_cases import naive_invalidate


def _kernel():
    from hisparse_triton.kernels import vllm_residency

    return vllm_residency.hisparse_invalidate_written_slots


def invalidate_case(rng, S=5, region=40, tokens=24):
    dgi = rng.integers(-1, 60, size=(S, region)).astype(np.int32)
    rsi = np.array([3, -1, 0, 7, 2], np.int32)                 # -1 padding, 7 out of range
    req = rng.integers(-2, 7, size=tokens).astype(np.int32)     # -ids and past the table
    # Written host rows: some held (several times in a row), some not, some negative.
    written = np.where(rng.random(tokens) < 0.7, rng.choice(dgi.reshape(-1), size=tokens),
                       rng.integers(-3, 80, size=tokens)).astype(np.int64)
    return dgi, rsi, req, written


@pytest.mark.parametrize("seed", range(4))
def test_torch_model_matches_scalar_walk(seed):
    dgi, rsi, req, written = invalidate_case(np.random.default_rng(seed))
    want = naive_invalidate(dgi, rsi, req, written)
    got = torch.from_numpy(dgi.copy())
    vllm_reference.hisparse_invalidate_written_slots(got, torch.from_numpy(rsi),
                                                     torch.from_numpy(req),
                                                     torch.from_numpy(written))
    np.testing.assert_array_equal(got.numpy(), want)
    assert not np.array_equal(want, dgi)


@pytest.mark.parametrize("region", [40, 1100])   # one block, several blocks per state row
def test_kernel_matches_torch_model(kernel_device, region):
    dgi, rsi, req, written = invalidate_case(np.random.default_rng(region), region=region)
    want = torch.from_numpy(dgi.copy())
    args = [torch.from_numpy(a) for a in (rsi, req, written)]
    vllm_reference.hisparse_invalidate_written_slots(want, *args)
    got = torch.from_numpy(dgi.copy()).to(kernel_device)
    _kernel()(got, *[a.to(kernel_device) for a in args])
    assert torch.equal(got.cpu(), want)


def test_no_tokens_is_a_no_op():
    dgi = torch.arange(12, dtype=torch.int32).view(3, 4)
    empty32, empty64 = torch.empty(0, dtype=torch.int32), torch.empty(0, dtype=torch.int64)
    for op in (vllm_reference.hisparse_invalidate_written_slots, _kernel()):
        op(dgi, torch.zeros(2, dtype=torch.int32), empty32, empty64)
    assert torch.equal(dgi, torch.arange(12, dtype=torch.int32).view(3, 4))


def test_bad_arguments_raise_and_change_nothing():
    dgi = torch.arange(12, dtype=torch.int32).view(3, 4)
    rsi = torch.zeros(2, dtype=torch.int32)
    for op in (vllm_reference.hisparse_invalidate_written_slots, _kernel()):
        with pytest.raises(RuntimeError, match="written_slots"):
            op(dgi, rsi, torch.zeros(2, dtype=torch.int32), torch.zeros(2, dtype=torch.int32))
        with pytest.raises(RuntimeError, match="equal length"):
            op(dgi, rsi, torch.zeros(3, dtype=torch.int32), torch.zeros(2, dtype=torch.int64))
    assert torch.equal(dgi, torch.arange(12, dtype=torch.int32).view(3, 4))
