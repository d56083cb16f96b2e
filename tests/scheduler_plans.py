"""Small HiSparse plans for the scheduler's own tests (no torch, no worker).

The ``tiny`` preset cut to 4 sparse layers in index groups of 2, block size 4, top-k 8, a
16-row hot buffer; optionally one full-attention and one sliding-window (window 8) layer.
"""

from hisparse_triton.presets import build_kv_cache_spec
from hisparse_triton.scheduler import HiSparseScheduler
from hisparse_triton.specs import FullAttentionSpec, SlidingWindowSpec
from hisparse_triton.workload import plan_for_workload

B, TOPK, BUFFER = 4, 8, 16
FULL, SWA = "model.layers.4.full_attn", "model.layers.5.swa"


def make_plan(*, max_num_seqs=3, max_model_len=64, device_blocks=None, host_blocks=None,
              full=False, window=False):
    spec = dict(build_kv_cache_spec("tiny", num_layers=4, block_size=B))
    if full:
        spec[FULL] = FullAttentionSpec(block_size=B, num_kv_heads=1, head_size=8, dtype="uint8")
    if window:
        spec[SWA] = SlidingWindowSpec(block_size=B, num_kv_heads=1, head_size=8, dtype="uint8",
                                      sliding_window=8)
    return plan_for_workload(spec, max_model_len=max_model_len, num_requests=max_num_seqs,
                             topk=TOPK, device_buffer_size=BUFFER, device_blocks=device_blocks,
                             host_blocks=host_blocks)


def make_scheduler(*, max_num_seqs=3, max_model_len=64, device_blocks=None, host_blocks=None,
                   full=False, window=False, watermark=0.1, threshold=None):
    plan = make_plan(max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                     device_blocks=device_blocks, host_blocks=host_blocks, full=full,
                     window=window)
    return HiSparseScheduler(plan.kv_cache_config, plan.config, max_num_seqs=max_num_seqs,
                             free_block_watermark=watermark, offload_threshold_pages=threshold)


def tokens(n, seed=0):
    """``n`` prompt token ids (a prefix of the same seed's longer prompt)."""
    return [(seed * 7919 + 31 * i) % 1000 for i in range(n)]
