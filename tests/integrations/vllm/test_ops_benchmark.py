"""The vLLM-op cost benchmark (``lab.vllm_ops``): its argument sets are
valid calls in vLLM's layout, the host-cost run makes one launch per op call, and a CUDA
graph captures a decode step's calls (GPU only)."""

from __future__ import annotations

import pytest
import torch

from lab import vllm_ops
from hisparse_triton.integrations import vllm as plugin
from hisparse_triton.integrations import vllm_reference

SMALL = dict(batch=4, top_k=64, hot_slots=128, block_size=16, seq_len=512, prefill_tokens=64)


def test_decode_call_args_plan_the_requested_misses():
    calls = vllm_ops.decode_call_args(**SMALL, miss_ratio=0.25)
    args = calls["hisparse_resolve_residency"]
    vllm_reference.hisparse_resolve_residency(*args)
    assert args[21].tolist() == [16] * 4            # swap_counts: 25% of 64 per request
    assert int(args[11].view(torch.int64)[0]) == 4 * 48
    for name in vllm_ops.OPS[1:]:
        getattr(vllm_reference, name)(*calls[name])


def test_host_cost_makes_one_launch_per_op_call():
    report = vllm_ops.host_cost(4, 64, 128, iters=2, repeats=1)
    assert set(report["ops"]) == set(vllm_ops.OPS)
    for name, row in report["ops"].items():
        assert row["launches"] == 1, name
        assert row["dispatch_us"] > 0 and row["launcher_us"] > 0
    assert report["providers"] == plugin.providers()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (a CUDA graph capture)")
def test_decode_step_calls_replay_from_a_cuda_graph():
    plugin.register()
    calls = vllm_ops.decode_call_args(**SMALL, device="cuda")
    args = calls["hisparse_resolve_residency"]
    dgi0, lru0 = args[5].clone(), args[6].clone()

    def step():
        torch.ops._C_cache_ops.hisparse_resolve_residency(*args)
        torch.ops._C_cache_ops.hisparse_gather_compact(args[0], args[1], args[19], args[20],
                                                       args[21])

    step()  # compile outside the capture
    args[5].copy_(dgi0), args[6].copy_(lru0)
    step()
    eager = [t.clone() for t in (args[4], args[5], args[6], args[19], args[20], args[21],
                                 args[1])]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    args[5].copy_(dgi0), args[6].copy_(lru0)
    args[1].zero_()
    graph.replay()
    torch.cuda.synchronize()
    for got, want in zip((args[4], args[5], args[6], args[19], args[20], args[21], args[1]),
                         eager):
        assert torch.equal(got, want)
