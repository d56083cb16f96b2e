"""``_C_cache_ops::hisparse_resolve_residency``: our torch model of vLLM 0.33's semantics,
checked against a scalar walk of vLLM's kernel phases and against hand-built cases from
vLLM's own kernel tests; the Triton kernel checked against the torch model bit for bit.

Rules come from vLLM 0.33.0's ``csrc/hisparse_kernels.cu``
(``hisparse_resolve_residency_kernel``) and its call site
``vllm/v1/hisparse/runtime.py`` (``HiSparseRuntime._resolve_residency``); vLLM itself is not
needed here.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hisparse_triton.integrations import vllm_reference
from vllm_op_cases import (POISON, ResolveCase, assert_same, naive_resolve, random_resolve_case,
                           resolve_args, run_resolve)


def _kernel():
    from hisparse_triton.kernels import vllm_residency

    return vllm_residency.hisparse_resolve_residency


def cold_case(top_k: int, hot_size: int, num_rows: int = 2, seed: int = 0) -> ResolveCase:
    """vLLM's ``Resolve`` test fixture: no source or resident tables (global indices are host
    rows), every row its own request, every slot empty: every column is a cold miss."""
    rng = np.random.default_rng(seed)
    hbs = 8
    host_rows = max(4096, top_k * 8)
    blocks = -(-hot_size // hbs)
    return ResolveCase(
        host_rows=host_rows, hot_num_blocks=num_rows * blocks, hot_block_size=hbs,
        hot_block_table=np.arange(num_rows * blocks, dtype=np.int32).reshape(num_rows, blocks),
        global_indices=np.stack([rng.choice(host_rows, size=top_k, replace=False)
                                 for _ in range(num_rows)]).astype(np.int32),
        dgi=np.full((num_rows, hot_size), -1, np.int32),
        lru=np.tile(np.arange(hot_size, dtype=np.int16), (num_rows, 1)),
        request_state_indices=np.arange(num_rows, dtype=np.int32), max_union_rows=top_k,
        attention_block_stride=hbs)


# --------------------------------------------------- the torch model, on vLLM's own cases


@pytest.mark.parametrize("top_k", [1, 31, 32, 33, 64])
def test_cold_start_fills_slots_in_lru_order(top_k):
    """vLLM ``test_resolve_cold_start_fills_slots_in_lru_order``: miss i takes LRU position
    i, the LRU rotates by top_k, every column is a planned miss."""
    case = cold_case(top_k, 2 * top_k, seed=top_k)
    out = run_resolve(vllm_reference.hisparse_resolve_residency, case)
    want_hot = np.array([[case.hot_block_table[r, i // 8] * 8 + i % 8 for i in range(top_k)]
                         for r in range(2)])
    np.testing.assert_array_equal(out["hot"], want_hot)
    np.testing.assert_array_equal(out["attn"], want_hot)
    np.testing.assert_array_equal(out["resolved"], case.global_indices)
    np.testing.assert_array_equal(out["miss"], np.ones((2, top_k)))
    np.testing.assert_array_equal(out["valid"], [top_k, top_k])
    np.testing.assert_array_equal(out["swap_counts"], [top_k, top_k])
    np.testing.assert_array_equal(out["swap_host"], case.global_indices)
    np.testing.assert_array_equal(out["swap_dev"], want_hot)
    rotated = np.roll(np.arange(2 * top_k), -top_k)
    np.testing.assert_array_equal(out["lru"], np.tile(rotated, (2, 1)))
    np.testing.assert_array_equal(out["stats"], [0, 2 * top_k])


def test_warm_replay_hits_without_moving_state():
    """vLLM ``test_resolve_warm_replay_hits_without_touching_state``: the same top-k again
    hits everything and is a fixed point of the state."""
    case = cold_case(33, 66, seed=3)
    first = run_resolve(vllm_reference.hisparse_resolve_residency, case)
    case.dgi, case.lru = first["dgi"].astype(np.int32), first["lru"].astype(np.int16)
    second = run_resolve(vllm_reference.hisparse_resolve_residency, case)
    np.testing.assert_array_equal(second["hot"], first["hot"])
    np.testing.assert_array_equal(second["swap_counts"], [0, 0])
    np.testing.assert_array_equal(second["miss"], np.zeros((2, 33)))
    np.testing.assert_array_equal(second["lru"], first["lru"])
    np.testing.assert_array_equal(second["dgi"], first["dgi"])
    np.testing.assert_array_equal(second["stats"], [2 * 33, 0])
    np.testing.assert_array_equal(second["swap_host"], np.full((2, 33), POISON))


def test_padding_rows_publish_minus_one():
    """vLLM ``test_resolve_padding_rows_publish_minus_one``: state -1 writes -1 / 0 and
    touches no state (nor miss_mask)."""
    case = cold_case(16, 32, num_rows=4, seed=99)
    case.request_state_indices = np.array([0, -1, 2, -1], np.int32)
    out = run_resolve(vllm_reference.hisparse_resolve_residency, case)
    for row in (1, 3):
        assert (out["hot"][row] == -1).all() and (out["attn"][row] == -1).all()
        assert (out["resolved"][row] == -1).all() and (out["miss"][row] == POISON).all()
        assert out["valid"][row] == 0 and out["swap_counts"][row] == 0
        np.testing.assert_array_equal(out["lru"][row], case.lru[row])
        np.testing.assert_array_equal(out["dgi"][row], case.dgi[row])


def test_out_of_range_lru_slot_degrades_to_remiss():
    """vLLM ``test_resolve_out_of_range_lru_slot_degrades_to_remiss``: a corrupted slot is
    never written; its entry resolves -1 and is not a miss."""
    case = cold_case(8, 8, num_rows=1, seed=2)
    case.lru[0, 0] = 8 + 5
    out = run_resolve(vllm_reference.hisparse_resolve_residency, case)
    bad = np.where(out["hot"][0] == -1)[0]
    assert len(bad) == 1 and out["miss"][0, bad[0]] == 0
    assert out["swap_dev"][0, 0] == -1 and out["swap_host"][0, 0] == case.global_indices[0, 0]
    assert out["swap_counts"][0] == 8 and out["stats"][1] == 7
    np.testing.assert_array_equal(out["lru"][0], np.roll(case.lru[0], 0))


def test_fully_resident_request_leaves_the_lru():
    """Every column resident (or masked): no union, no LRU rewrite, no plan."""
    case = random_resolve_case(np.random.default_rng(5), rows_per_request=[2], top_k=8,
                               hot_size=16)
    case.resident_block_table[:] = 7
    out = run_resolve(vllm_reference.hisparse_resolve_residency, case)
    st = case.request_state_indices[0]
    np.testing.assert_array_equal(out["lru"][st], case.lru[st])
    np.testing.assert_array_equal(out["swap_counts"][:2], [0, 0])
    assert (out["swap_host"] == POISON).all() and (out["miss"][:2] == 0).all()
    pos = case.global_indices[:2]
    want = np.where(pos >= 0, 7 * 4 + pos % 4, -1)
    np.testing.assert_array_equal(out["hot"][:2], want)


def with_identity_source(case: ResolveCase, request_ids: list[int]) -> ResolveCase:
    """``case`` in vLLM's decode form: rows grouped by ``request_ids``, positions translated
    by a source table whose page ``b`` is host block ``b + 1`` (block 0 is the null block),
    so position ``p`` is host row ``p + block_size``."""
    bs = 4
    pages = -(-case.host_rows // bs)
    requests = max(request_ids) + 1
    case.request_ids = np.array(request_ids, np.int32)
    case.request_state_indices = np.arange(requests, dtype=np.int32)
    case.source_block_table = np.tile(np.arange(1, pages + 1, dtype=np.int32), (requests, 1))
    case.source_block_size = bs
    case.host_rows += bs
    return case


def test_mtp_rows_resolve_one_union():
    """Two verification rows selecting the same host rows load each once: the second row's
    references reuse the first row's slots; misses fill the request's rows in order."""
    case = cold_case(8, 24, num_rows=2, seed=11)
    case.global_indices[1, :4] = case.global_indices[0, 4:]
    case = with_identity_source(case, [0, 0])
    case.max_union_rows = 16
    want = naive_resolve(case)
    assert_same(run_resolve(vllm_reference.hisparse_resolve_residency, case), want)
    np.testing.assert_array_equal(want["hot"][1, :4], want["hot"][0, 4:])
    np.testing.assert_array_equal(want["swap_host"][0], case.global_indices[0] + 4)
    assert want["swap_counts"].tolist() == [8, 4]
    assert want["miss"][1, :4].sum() == 0 and want["miss"][1, 4:].sum() == 4
    assert want["stats"].tolist() == [4, 12]


# ------------------------------------------------ the torch model against the scalar walk


CASES = {
    "decode": dict(rows_per_request=[1, 1, 1], top_k=8, hot_size=16),
    "mtp": dict(rows_per_request=[2, 3, 1], top_k=8, hot_size=32),
    "mtp-interleaved": dict(rows_per_request=[2, 3, 1], top_k=8, hot_size=32,
                            shuffle_rows=True),
    "padding": dict(rows_per_request=[1, 2], top_k=8, hot_size=16, padding_rows=3),
    "cold": dict(rows_per_request=[2, 1], top_k=8, hot_size=16, warm=False),
    "duplicates": dict(rows_per_request=[2, 1], top_k=8, hot_size=16, duplicates=True),
    "no-resident": dict(rows_per_request=[1, 2], top_k=8, hot_size=24, resident=False),
    "corrupt-lru": dict(rows_per_request=[1, 1], top_k=8, hot_size=16, corrupt_lru=True),
    "tight": dict(rows_per_request=[3], top_k=8, hot_size=8),   # more misses than slots
}


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("name", list(CASES))
def test_torch_model_matches_scalar_walk(name, seed):
    case = random_resolve_case(np.random.default_rng(seed), **CASES[name])
    assert_same(run_resolve(vllm_reference.hisparse_resolve_residency, case),
                naive_resolve(case))


def test_state_row_shared_by_two_requests_resolves_once():
    """Two requests naming one state row: the one with the earlier first row resolves, the
    other's rows are padding (vLLM would race on the state)."""
    case = random_resolve_case(np.random.default_rng(1), rows_per_request=[1, 1], top_k=8,
                               hot_size=16)
    case.request_state_indices[1] = case.request_state_indices[0]
    out = run_resolve(vllm_reference.hisparse_resolve_residency, case)
    assert_same(out, naive_resolve(case))
    assert (out["hot"][1] == -1).all() and out["valid"][1] == 0


def test_optional_outputs_absent():
    case = random_resolve_case(np.random.default_rng(2), rows_per_request=[2, 1], top_k=8,
                               hot_size=16)
    got = run_resolve(vllm_reference.hisparse_resolve_residency, case, optional_outputs=False)
    assert_same(got, naive_resolve(case), ["hot", "swap_host", "swap_dev", "swap_counts", "dgi",
                                           "lru", "stats"])


# ------------------------------------------------------------- argument checks (no state)


BAD_ARGUMENTS = {
    "max_union_rows": (9, 17),                        # above the hot size
    "lru_slots": (6, lambda t: t.to(torch.int32)),    # int16 only
    "region_stride": (8, 15),
    "hot_indices": (4, lambda t: t[:, :4]),
    "request_ids": (14, None),                        # without the source table
    "attention_block_stride": (13, 1),
    "swap_counts": (21, None),                        # swaps come together
    "stats": (11, lambda t: t.view(torch.int64)),
}


@pytest.mark.parametrize("name", list(BAD_ARGUMENTS))
def test_bad_arguments_raise_and_change_nothing(name):
    case = random_resolve_case(np.random.default_rng(0), rows_per_request=[1, 2], top_k=8,
                               hot_size=16)
    args, outs = resolve_args(case)
    before = {k: v.clone() for k, v in outs.items()}
    index, change = BAD_ARGUMENTS[name]
    args[index] = change(args[index]) if callable(change) else change
    for op in (vllm_reference.hisparse_resolve_residency, _kernel()):
        with pytest.raises(RuntimeError, match=name):  # vLLM's type (test_ops_checks.py)
            op(*args)
        for key, tensor in outs.items():
            assert torch.equal(tensor, before[key]), key


# ------------------------------------------------------------ the Triton kernel, bit-exact


@pytest.mark.parametrize("name", list(CASES))
def test_triton_kernel_matches_torch_model(kernel_device, name):
    case = random_resolve_case(np.random.default_rng(7), **CASES[name])
    want = run_resolve(vllm_reference.hisparse_resolve_residency, case)
    assert_same(run_resolve(_kernel(), case, kernel_device), want)


@pytest.mark.parametrize("top_k", [1, 33])
def test_triton_kernel_cold_and_warm(kernel_device, top_k):
    case = cold_case(top_k, 2 * top_k, seed=top_k)
    for _ in range(2):
        want = run_resolve(vllm_reference.hisparse_resolve_residency, case)
        assert_same(run_resolve(_kernel(), case, kernel_device), want)
        case.dgi, case.lru = want["dgi"].astype(np.int32), want["lru"].astype(np.int16)


@pytest.mark.parametrize("sort_width,block_h", [(16, 16), (32, 16), (16, 64)])
def test_triton_kernel_tiles_and_merge_passes(kernel_device, sort_width, block_h):
    """Small register tiles: top-k 40 sorts as 16- or 32-key tiles merged in scratch (both
    buffer parities), the 48-slot LRU in steps of 16."""
    from hisparse_triton.kernels import vllm_residency

    def op(*args):
        vllm_residency.hisparse_resolve_residency(*args, sort_width=sort_width,
                                                  block_h=block_h)

    case = random_resolve_case(np.random.default_rng(sort_width + block_h),
                               rows_per_request=[2, 1, 2], top_k=40, hot_size=48,
                               positions=120, host_blocks=60, shuffle_rows=True,
                               padding_rows=1)
    want = run_resolve(vllm_reference.hisparse_resolve_residency, case)
    assert_same(run_resolve(op, case, kernel_device), want)


def test_triton_kernel_over_several_steps(kernel_device):
    """Three decode steps of MTP requests, the state carried from step to step: every
    output and the state stay equal to the torch model's."""
    rng = np.random.default_rng(21)
    case = random_resolve_case(rng, rows_per_request=[2, 2, 1], top_k=16, hot_size=40,
                               positions=64)
    for step in range(3):
        want = run_resolve(vllm_reference.hisparse_resolve_residency, case)
        assert_same(run_resolve(_kernel(), case, kernel_device), want)
        case.dgi, case.lru = want["dgi"].astype(np.int32), want["lru"].astype(np.int16)
        case.stats = want["stats"].astype(np.uint64)
        fresh = random_resolve_case(np.random.default_rng(100 + step),
                                    rows_per_request=[2, 2, 1], top_k=16, hot_size=40,
                                    positions=64)
        keep = rng.random(case.global_indices.shape) < 0.5   # half the selection repeats
        case.global_indices = np.where(keep, case.global_indices, fresh.global_indices)


@pytest.mark.slow
def test_triton_kernel_at_deepseek_shapes(kernel_device):
    """vLLM ``test_resolve_production_shapes``: top-k 2048 into 4096 slots (the register
    tiles of production: one 2048-key sort, 4096 LRU positions per step), a warm state that
    holds half of the selection."""
    case = with_identity_source(cold_case(2048, 4096, num_rows=1, seed=8), [0])
    rng = np.random.default_rng(8)
    g = case.global_indices[0] + 4                     # host rows (identity source, +1 block)
    held = rng.permutation(4096)
    case.dgi[0, held[:1024]] = g[:1024]
    others = np.setdiff1d(np.arange(case.host_rows), g)   # held rows nobody selects
    case.dgi[0, held[1024:1536]] = rng.choice(others, 512, replace=False)
    case.lru[0] = rng.permutation(4096).astype(np.int16)
    want = run_resolve(vllm_reference.hisparse_resolve_residency, case)
    assert want["swap_counts"][0] == 1024 and want["stats"].tolist() == [1024, 1024]
    assert_same(run_resolve(_kernel(), case, kernel_device), want)
