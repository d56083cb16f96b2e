"""vLLM 0.33.0's HiSparse scheduler and worker halves on our ops, step by step, exact.

vLLM's ``Scheduler`` (with its ``KVCacheManager``, ``HiSparseCoordinator`` and the
``HiSparseConnector`` it creates) plans every step; ``HiSparseConnector`` in the worker role
runs it over ``HiSparseRuntime``s built by vLLM's index-group builder; the ops are ours,
registered by vLLM's own plugin loader from this project's entry point. A minimal model
runner (``vllm_stack``) writes each token's KV row and picks each query's top-k; every row
the attention kernels would read is compared with the row written for that position (see
``vllm_stack`` for what is checked). Preemption comes from a small device pool, prefill
staging from pages the coordinator released, followers from a layer sharing its leader's
indexer. Both backends run: the torch models and the Triton kernels (interpreter on CPU).
"""

from __future__ import annotations

import functools

import pytest

pytestmark = pytest.mark.needs_vllm

#: Three sparse layers: layer 0 leads layer 1 (a follower replaying its misses), layer 2
#: leads alone. 130 device blocks hold about 1.5 of these requests' admission windows.
SMALL = dict(num_layers=3, leaders=(0, 2), num_gpu_blocks=130)
ALL_PATHS = {"decode", "mixed-decode", "resident-prefill", "staged-prefill", "fp8-prefill"}


@functools.lru_cache(maxsize=None)
def _serve(backend: str, scenario: str):
    """Run one scenario on one backend (cached: the backend comparison reuses it)."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        return _run(backend, scenario, monkeypatch)


def _run(backend: str, scenario: str, monkeypatch: pytest.MonkeyPatch):
    """Load the plugins as vLLM does, install the CPU stand-ins, serve ``scenario``."""
    from vllm_stack import HiSparseStack, RequestSpec, StackShape, random_requests

    import cpu_standins
    import vllm.plugins
    from hisparse_triton.integrations import vllm as plugin

    monkeypatch.setenv("HISPARSE_TRITON_BACKEND", backend)
    # A fresh process state for vLLM's loader: it runs every general plugin once.
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    vllm.plugins.load_general_plugins()
    assert set(plugin.providers().values()) == {"hisparse_triton"}
    dma = cpu_standins.install(monkeypatch)
    arrivals = None
    if scenario == "small":
        shape = StackShape(**SMALL)
        requests = random_requests(3, 0, prompt_lens=(200, 420), max_tokens=(4, 9))
        max_steps = 40
    elif scenario == "long":
        shape = StackShape(num_gpu_blocks=160)
        requests = random_requests(4, 0, prompt_lens=(150, 600), max_tokens=(8, 30))
        max_steps = 150
    else:  # "prefix": two more requests with the first two's prompts arrive at step 12
        shape = StackShape(**SMALL)
        requests = random_requests(2, 1, prompt_lens=(300, 420), max_tokens=(12, 16),
                                   shared_prefix=256)
        arrivals = {12: [RequestSpec(f"late-{spec.request_id}", spec.prompt, 4)
                         for spec in requests]}
        max_steps = 80
    stack = HiSparseStack(shape, dma)
    try:
        counts = stack.run(requests, max_steps=max_steps, arrivals=arrivals)
        assert not dma.pending
    finally:
        stack.close()
    return counts


def _assert_exercised(counts, *, requests: int) -> None:
    assert counts.finished == requests
    assert counts.paths == ALL_PATHS, counts.paths
    assert counts.hits > 0 and counts.misses > 0, counts
    assert counts.padding_rows > 0 and counts.decode_rows > 0, counts
    assert counts.staged_prefill_rows > 0 and counts.fp8_workspace_rows > 0, counts
    assert counts.residency_updates > 0 and counts.dma_copies > 0, counts


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_stack_serves_exactly(backend):
    counts = _serve(backend, "small")
    _assert_exercised(counts, requests=3)
    assert counts.preemptions >= 1, counts


def test_backends_agree_step_for_step():
    torch_run, triton_run = _serve("torch", "small"), _serve("triton", "small")
    assert triton_run == torch_run


def test_stack_long_run_with_preemptions():
    counts = _serve("torch", "long")
    _assert_exercised(counts, requests=4)
    assert counts.preemptions >= 5 and counts.steps > 60, counts


def test_stack_prefix_reuse_reads_host_pages():
    counts = _serve("torch", "prefix")
    _assert_exercised(counts, requests=4)
    assert counts.prefix_hit_tokens >= 2 * 256, counts


def _corrupt_after(name: str, corrupt):
    """``torch.ops._C_cache_ops.<name>`` that runs the real op, then ``corrupt(args)``."""
    import torch

    real = getattr(torch.ops._C_cache_ops, name)

    def call(*args, **kwargs):
        real(*args, **kwargs)
        corrupt(args, kwargs)
    return call


def _drop_first_copy(args, kwargs):  # hisparse_gather_compact(host, hot, src, dst, counts)
    hot, dst, counts = args[1], args[3], args[4]  # hot: [blocks, B, row], strided
    planned = (counts > 0).nonzero().flatten()
    if planned.numel():
        row = int(dst[int(planned[0]), 0])
        hot[row // hot.shape[1], row % hot.shape[1]] ^= 1


def _swap_two_columns(args, kwargs):  # hisparse_resolve_residency(..., attention_indices=...)
    attention = args[12]
    attention[0, [0, 1]] = attention[0, [1, 0]].clone()


def _flip_staged_host_rows(args, kwargs):  # hisparse_gather_plan(host, staged, rows, dst, mask)
    staged, dst, mask = args[1], args[3], args[4]
    staged.reshape(-1, staged.shape[-1])[dst[mask.bool()].long()] ^= 1


def _nudge_first_workspace_row(args, kwargs):  # cp_gather_and_upconvert_fp8_kv_cache
    dst = args[1]
    dst[0, 0] = dst[0, 0] + 1


@pytest.mark.parametrize("name, corrupt", [
    ("hisparse_gather_compact", _drop_first_copy),
    ("hisparse_resolve_residency", _swap_two_columns),
    ("hisparse_gather_plan", _flip_staged_host_rows),
    ("cp_gather_and_upconvert_fp8_kv_cache", _nudge_first_workspace_row),
])
def test_a_wrong_op_result_is_caught(monkeypatch, name, corrupt):
    """The row checks are live: one wrong byte from any op the stack reads through fails."""
    import torch

    import vllm.plugins
    monkeypatch.setattr(vllm.plugins, "plugins_loaded", False)
    vllm.plugins.load_general_plugins()
    monkeypatch.setattr(torch.ops._C_cache_ops, name, _corrupt_after(name, corrupt))
    with pytest.raises(AssertionError, match="layer"):
        _run("torch", "small", monkeypatch)
