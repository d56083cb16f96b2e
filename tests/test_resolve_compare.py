"""``lab.resolve_compare`` (``bench/gpu_check.py``'s ``resolve_vs_vllm`` section): the step
given to vLLM's op in vLLM's layout is the step our resolves get, so the GPU times compare like
for like. Checked here with the torch model of vLLM's op and our Triton form of it (the
interpreter on CPU); vLLM's compiled op is only timed on a GPU."""

from __future__ import annotations

import torch

from hisparse_triton import benchmarks as bm
from hisparse_triton.integrations import vllm_reference
from hisparse_triton.kernels import vllm_residency
from lab import decode_checks, resolve_compare as rc


def _work(device: torch.device) -> bm.ResolveWorkload:
    return bm.ResolveWorkload(3, 16, 32, 512, 0.25, device)


def test_vllm_form_resolves_the_same_step(kernel_device: torch.device) -> None:
    """Both of our resolves (hash, sorted) and both forms of vLLM's op (the torch model, our
    Triton kernel) give the same rows, plans and state on the translated step."""
    work = _work(kernel_device)
    ours = rc._ours(work)
    assert list(ours) == ["hash", "sorted"]
    for name, call in ours.items():
        for op in (vllm_reference.hisparse_resolve_residency,
                   vllm_residency.hisparse_resolve_residency):
            assert rc.check_same_step(work, op, call), (name, op.__module__)
    # the check can fail: an op that leaves everything as it was is not the same step
    assert not rc.check_same_step(work, lambda *args: None, ours["hash"])


def test_vllm_args_follow_the_workload() -> None:
    """Tables by request (one row per request), hot state by state row, int16 LRU."""
    work = _work(torch.device("cpu"))
    args = rc.vllm_args(work)
    topk, state_rows, _, resident, host_blocks, hot_blocks, slot_rows, lru = work.args()
    assert args[3] is topk and args[5] is slot_rows and args[7] is state_rows
    assert args[6].dtype == torch.int16 and torch.equal(args[6].int(), lru)
    assert torch.equal(args[2], hot_blocks[state_rows.long()])
    assert torch.equal(args[15], host_blocks[state_rows.long()]) and args[22] is resident
    assert (args[8], args[9]) == (lru.shape[1], topk.shape[1])


def test_section_is_listed_and_skips_without_cuda() -> None:
    assert "resolve_vs_vllm" in decode_checks.SECTIONS
    out = decode_checks.SECTIONS["resolve_vs_vllm"](torch.device("cpu"), True)
    assert "skipped" in out
