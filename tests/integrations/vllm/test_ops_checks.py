"""Every argument check of the five vLLM 0.33 ops raises ``RuntimeError``, the type vLLM's own
ops raise, and changes nothing: on the torch model, the Triton launcher and through
``torch.ops._C_cache_ops`` (as vLLM calls them).

vLLM 0.33.0 checks its ops' arguments with ``STD_TORCH_CHECK`` / ``TORCH_CHECK``
(``csrc/hisparse_kernels.cu``: ``hisparse_resolve_residency``, ``hisparse_gather_plan``,
``hisparse_gather_compact``, ``hisparse_invalidate_written_slots`` and their ``check_2d_rows``;
``csrc/cache_kernels.cu``: ``cp_gather_and_upconvert_fp8_kv_cache``); each surfaces in Python
as ``RuntimeError`` (``vllm/_custom_ops.py`` adds no check of its own). Where vLLM makes the
same check, our message carries vLLM's text verbatim (the ``vllm`` column below), so a test
that matches vLLM's message matches ours; the checks only we make (one device for all index
tensors, layouts the kernels rely on, ``batch_size`` within the tables) name the argument.
vLLM is not needed here.
"""

from __future__ import annotations

import inspect
import re
from typing import Any, Callable, NamedTuple, Optional

import numpy as np
import pytest
import torch

from hisparse_triton.integrations import vllm as plugin
from hisparse_triton.integrations import vllm_checks, vllm_reference
from vllm_op_cases import random_resolve_case, resolve_args

i32, i64 = torch.int32, torch.int64


class Check(NamedTuple):
    """One refused call: ``mutate`` turns a valid argument dict into the bad one; ``vllm`` is
    vLLM's message for the same check (None: a check only we make); ``names`` is a fragment
    of our message (the bad argument)."""

    mutate: Callable[[dict], Any]
    vllm: Optional[str]
    names: str


def _set(**values) -> Callable[[dict], None]:
    """A mutation that sets arguments: a value, or a function of the valid argument dict."""
    def mutate(a: dict) -> None:
        for name, value in values.items():
            a[name] = value(a) if callable(value) else value
    return mutate


def _to(name: str, dtype) -> Callable[[dict], None]:
    return _set(**{name: lambda a: a[name].to(dtype)})


def _meta(name: str) -> Callable[[dict], None]:
    """The argument on another device (meta: shapes only, never read)."""
    return _set(**{name: lambda a: a[name].to("meta")})


def _flat(name: str) -> Callable[[dict], None]:
    return _set(**{name: lambda a: a[name].reshape(-1)})


def _column_major(name: str) -> Callable[[dict], None]:
    """The same values and shape, last stride > 1 (not row-major, not contiguous)."""
    return _set(**{name: lambda a: a[name].t().contiguous().t()})


def _strided(name: str) -> Callable[[dict], None]:
    """The same shape, every second element of a wider tensor (not contiguous)."""
    return _set(**{name: lambda a: torch.cat([a[name], a[name]], -1)[..., ::2]})


def _cut(name: str, rows: Optional[int] = None, cols: Optional[int] = None
         ) -> Callable[[dict], None]:
    """The argument with fewer rows or columns (contiguous)."""
    def cut(a: dict) -> torch.Tensor:
        t = a[name]
        t = t[:rows] if rows is not None else t
        return (t[..., :cols] if cols is not None else t).contiguous()
    return _set(**{name: cut})


def _host(rows: int = 40, row_bytes: int = 16) -> torch.Tensor:
    return torch.zeros(rows, row_bytes, dtype=torch.uint8)


def _host_cache_checks(row_bytes: int, vllm: bool = True) -> dict[str, Check]:
    """vLLM's ``check_2d_rows(host_cache)`` (``vllm``: with its messages; the FP8 gather's
    host-row checks are not in the sources we read) and our device rule."""
    return {
        "host_cache 2-D": Check(_flat("host_cache"), "host_cache must be 2D" if vllm else None,
                                "host_cache"),
        "host_cache contiguous": Check(_set(host_cache=lambda a: a["host_cache"][::2]),
                                      "host_cache must be contiguous" if vllm else None,
                                      "host_cache"),
        "host_cache row width": Check(_set(host_cache=_host(40, row_bytes + 16)),
                                      "host_cache row width mismatch" if vllm else None,
                                      "host_cache"),
        "host_cache device": Check(_meta("host_cache"), None, "host_cache is on meta"),
    }


def _hot_cache_checks(three_d_only: bool) -> dict[str, Check]:
    """vLLM's hot-cache checks (paged 3-D only, or also a 2-D staging buffer) and our device
    rule."""
    return {
        "hot_cache shape": Check(
            _set(hot_cache=lambda a: a["hot_cache"].reshape(
                (-1, 16) if three_d_only else (2, 3, 4, 16))),
            "hot_cache must be [num_blocks, block_size, row_width]" if three_d_only
            else "hot_cache must be a 2D staging buffer or paged 3D cache", "hot_cache"),
        "row 16-byte aligned": Check(
            _set(hot_cache=lambda a: a["hot_cache"][..., :8].contiguous(),
                 host_cache=_host(40, 8)), "KV rows must be 16-byte aligned", "8 B"),
        "hot rows contiguous": Check(_strided("hot_cache"), "hot-cache rows must be contiguous",
                                     "hot_cache"),
        "hot_cache device": Check(_meta("hot_cache"), None, "hot_cache is on meta"),
    }


# ------------------------------------------------------------------------------ resolve


def _resolve_args() -> dict:
    case = random_resolve_case(np.random.default_rng(0), rows_per_request=[1, 2], top_k=8,
                               hot_size=16)       # R 3, K 8, H 16, 5 state rows, blocks of 4
    args, _ = resolve_args(case)
    return dict(zip(inspect.signature(vllm_reference.hisparse_resolve_residency).parameters,
                    args))


def _without_request_tables(a: dict) -> None:
    """No request_ids / source table (global indices are host rows): one hot row per row."""
    a.update(request_ids=None, source_block_table=None, resident_block_table=None,
             resident_block_size=0, hot_block_table=a["hot_block_table"].repeat(2, 1))


RESOLVE = {
    "global_indices dtype": Check(_to("global_indices", i64),
                                  "global_indices/hot_indices must be int32", "global_indices"),
    "global_indices 2-D": Check(_flat("global_indices"), "global_indices must be row-major 2D",
                                "global_indices"),
    "global_indices row-major": Check(_column_major("global_indices"),
                                      "global_indices must be row-major 2D", "global_indices"),
    **_hot_cache_checks(three_d_only=True),
    **_host_cache_checks(16),
    "hot_block_table dtype": Check(_to("hot_block_table", i64),
                                   "hot_block_table must be a 2D int32 CUDA tensor",
                                   "hot_block_table"),
    "hot_block_table 2-D": Check(_flat("hot_block_table"),
                                 "hot_block_table must be a 2D int32 CUDA tensor",
                                 "hot_block_table"),
    "hot_block_table row-major": Check(_column_major("hot_block_table"), None,
                                       "hot_block_table must be row-major"),
    "hot_indices dtype": Check(_to("hot_indices", i64),
                               "global_indices/hot_indices must be int32", "hot_indices"),
    "hot_indices shape": Check(_cut("hot_indices", cols=4),
                               "hot_indices must have one contiguous row per launch row",
                               "hot_indices"),
    "hot_indices contiguous": Check(_strided("hot_indices"),
                                    "hot_indices must have one contiguous row per launch row",
                                    "hot_indices"),
    "device_global_indices dtype": Check(_to("device_global_indices", i64),
                                         "device_global_indices must be int32",
                                         "device_global_indices"),
    "device_global_indices contiguous": Check(_strided("device_global_indices"),
                                              "device_global_indices must be contiguous 2D",
                                              "device_global_indices"),
    "lru_slots dtype": Check(_to("lru_slots", i32), "lru_slots must be int16", "lru_slots"),
    "lru_slots contiguous": Check(
        _strided("lru_slots"), "lru_slots must be contiguous with one row per request state",
        "lru_slots"),
    "lru_slots rows": Check(_cut("lru_slots", rows=4),
                            "lru_slots must be contiguous with one row per request state",
                            "4 state rows"),
    "hot size >= top_k": Check(_cut("lru_slots", cols=7), "hot buffer size must be >= top_k",
                               "hot buffer size 7"),
    "hot size fits int16": Check(
        _set(lru_slots=torch.zeros(5, 32769, dtype=torch.int16)),
        "hot buffer size must fit int16 slots", "32769"),
    "region_stride": Check(_set(region_stride=15), "region_stride must match the LRU size",
                           "region_stride 15"),
    "device_global_indices columns": Check(
        _cut("device_global_indices", cols=15),
        "device_global_indices must cover the full hot region", "15 columns"),
    "hot_block_table columns": Check(_cut("hot_block_table", cols=3),
                                     "hot_block_table has too few columns", "3 columns"),
    "hot rows fit int32": Check(  # 2**31 rows of one real block (stride 0: no memory)
        _set(hot_cache=lambda a: a["hot_cache"][:1].expand(2**29 + 1, 4, 16)),
        "hot indices must fit int32", "hot-cache rows"),
    "request_ids with source table": Check(
        _set(request_ids=None), "request_ids and source_block_table must be provided together",
        "request_ids is None"),
    "request_ids dtype": Check(
        _to("request_ids", i64),
        "request_ids must be contiguous int32 on CUDA with one entry per row", "request_ids"),
    "request_ids per row": Check(
        _cut("request_ids", rows=2),
        "request_ids must be contiguous int32 on CUDA with one entry per row", "request_ids"),
    "source_block_table dtype": Check(
        _to("source_block_table", i64),
        "source_block_table must be a row-major 2D int32 CUDA tensor", "source_block_table"),
    "source_block_table row-major": Check(
        _column_major("source_block_table"),
        "source_block_table must be a row-major 2D int32 CUDA tensor", "source_block_table"),
    "source_block_size": Check(_set(source_block_size=0), "source_block_size must be positive",
                               "source_block_size 0"),
    "hot_block_table rows": Check(_cut("hot_block_table", rows=1),
                                  "hot_block_table has too few rows", "1 rows"),
    "resident lookup needs the source table": Check(
        lambda a: (_without_request_tables(a),
                   a.update(resident_block_table=torch.zeros(3, 4, dtype=i32))),
        "resident lookup requires request_ids and source_block_table", "resident_block_table"),
    "resident_block_table dtype": Check(
        _to("resident_block_table", i64),
        "resident_block_table must be a row-major 2D int32 CUDA tensor",
        "resident_block_table"),
    "resident_block_table row-major": Check(
        _column_major("resident_block_table"),
        "resident_block_table must be a row-major 2D int32 CUDA tensor",
        "resident_block_table"),
    "resident block size": Check(_set(resident_block_size=8),
                                 "resident and hot block sizes must match",
                                 "resident block size 8"),
    "resident null block": Check(_set(resident_null_block=-1),
                                 "resident null block must be non-negative",
                                 "resident_null_block -1"),
    "resolved_global_indices": Check(
        _cut("resolved_global_indices", cols=4),
        "resolved_global_indices must be contiguous int32 matching indices",
        "resolved_global_indices"),
    "miss_mask": Check(_to("miss_mask", i64),
                       "miss_mask must be a contiguous int32 CUDA tensor matching "
                       "global_indices", "miss_mask"),
    "valid_counts dtype": Check(_to("valid_counts", i64),
                                "valid_counts must be int32 on CUDA with one entry per row",
                                "valid_counts"),
    "valid_counts per row": Check(_cut("valid_counts", rows=2),
                                  "valid_counts must be int32 on CUDA with one entry per row",
                                  "valid_counts"),
    "swaps together": Check(_set(swap_counts=None),
                            "compact swap tensors must be provided together", "swap_counts"),
    "swap rows shape": Check(_cut("swap_host_physical_rows", cols=4),
                             "compact swaps must be contiguous int32 matching indices",
                             "swap_host_physical_rows"),
    "swap_counts per row": Check(_cut("swap_counts", rows=2),
                                 "compact swaps must be contiguous int32 matching indices",
                                 "swap_counts"),
    "request_state_indices dtype": Check(
        _to("request_state_indices", i64),
        "request_state_indices must be contiguous 1D int32 on CUDA", "request_state_indices"),
    "request_state_indices contiguous": Check(
        _set(request_state_indices=lambda a: a["request_state_indices"].repeat(2)[::2]),
        "request_state_indices must be contiguous 1D int32 on CUDA", "request_state_indices"),
    "state rows without request_state_indices": Check(
        _set(request_state_indices=None,
             device_global_indices=lambda a: a["device_global_indices"][:2].contiguous(),
             lru_slots=lambda a: a["lru_slots"][:2].contiguous()),
        "device_global_indices has too few rows", "2 rows for 3 rows"),
    "stats dtype": Check(_set(stats=torch.zeros(2, dtype=i64)),
                         "stats must be a contiguous two-element uint64 CUDA tensor", "stats"),
    "stats two elements": Check(_set(stats=torch.zeros(3, dtype=torch.uint64)),
                                "stats must be a contiguous two-element uint64 CUDA tensor",
                                "stats"),
    "attention_indices": Check(
        _cut("attention_indices", cols=4),
        "attention_indices must be row-major int32 matching global_indices",
        "attention_indices"),
    "attention block stride": Check(_set(attention_block_stride=3),
                                    "attention block stride must cover one hot block",
                                    "attention_block_stride 3"),
    "max_union_rows positive": Check(_set(max_union_rows=0),
                                     "max_union_rows must be in [1, hot_size]",
                                     "max_union_rows 0"),
    "max_union_rows within the hot buffer": Check(_set(max_union_rows=17),
                                                  "max_union_rows must be in [1, hot_size]",
                                                  "max_union_rows 17"),
    "index tensors on one device": Check(_meta("hot_block_table"), None,
                                         "hot_block_table is on meta"),
}


# ------------------------------------------------------------------------------ gathers


def _plan_args() -> dict:
    z = lambda *shape: torch.zeros(shape, dtype=i32)  # noqa: E731
    return dict(host_cache=_host(), hot_cache=torch.zeros(6, 4, 16, dtype=torch.uint8),
                global_indices=z(2, 8), hot_indices=z(2, 8), miss_mask=z(2, 8),
                request_state_indices=z(2), attention_indices=z(2, 8),
                attention_block_stride=4)


def _compact_args() -> dict:
    z = lambda *shape: torch.zeros(shape, dtype=i32)  # noqa: E731
    return dict(host_cache=_host(), hot_cache=torch.zeros(6, 4, 16, dtype=torch.uint8),
                miss_global_indices=z(2, 8), miss_hot_indices=z(2, 8), miss_counts=z(2))


PLAN_MATCH = "hot_indices/miss_mask must match contiguous 2D global_indices"
GATHER_PLAN = {
    "global_indices dtype": Check(_to("global_indices", i64), "plan tensors must be int32",
                                  "global_indices"),
    "global_indices 2-D": Check(_flat("global_indices"), "global_indices must be contiguous 2D",
                                "global_indices"),
    "global_indices contiguous": Check(_strided("global_indices"),
                                       "global_indices must be contiguous 2D",
                                       "global_indices"),
    "hot_indices dtype": Check(_to("hot_indices", i64), "plan tensors must be int32",
                               "hot_indices"),
    "hot_indices shape": Check(_cut("hot_indices", cols=4), PLAN_MATCH, "hot_indices"),
    "miss_mask dtype": Check(_to("miss_mask", i64), "plan tensors must be int32", "miss_mask"),
    "miss_mask contiguous": Check(_strided("miss_mask"), PLAN_MATCH, "miss_mask"),
    "staging buffer rows contiguous": Check(
        _set(hot_cache=lambda a: torch.zeros(24, 32, dtype=torch.uint8)[:, :16]),
        "hot-cache rows must be contiguous", "hot_cache"),
    **_hot_cache_checks(three_d_only=False),
    **_host_cache_checks(16),
    "request_state_indices dtype": Check(
        _to("request_state_indices", i64),
        "request_state_indices must be int32 on CUDA with one entry per row",
        "request_state_indices"),
    "request_state_indices per row": Check(
        _cut("request_state_indices", rows=1),
        "request_state_indices must be int32 on CUDA with one entry per row",
        "request_state_indices"),
    "attention_indices": Check(
        _cut("attention_indices", cols=4),
        "attention_indices must be a contiguous int32 CUDA tensor matching global_indices",
        "attention_indices"),
    "attention block stride": Check(_set(attention_block_stride=3),
                                    "attention block stride must cover one hot block",
                                    "attention_block_stride 3"),
    "index tensors on one device": Check(_meta("miss_mask"), None, "miss_mask is on meta"),
}

COMPACT_PLAN = "compact miss plan must be matching contiguous int32 CUDA tensors"
GATHER_COMPACT = {
    "miss_global_indices dtype": Check(_to("miss_global_indices", i64), COMPACT_PLAN,
                                       "miss_global_indices"),
    "miss_global_indices contiguous": Check(_strided("miss_global_indices"), COMPACT_PLAN,
                                            "miss_global_indices"),
    "miss_hot_indices shape": Check(_cut("miss_hot_indices", cols=4), COMPACT_PLAN,
                                    "miss_hot_indices"),
    "miss_counts dtype": Check(_to("miss_counts", i64), COMPACT_PLAN, "miss_counts"),
    "miss_counts per row": Check(_cut("miss_counts", rows=1), COMPACT_PLAN, "miss_counts"),
    **_hot_cache_checks(three_d_only=True),
    **_host_cache_checks(16),
    "index tensors on one device": Check(_meta("miss_counts"), None, "miss_counts is on meta"),
}


# ------------------------------------------------------------------------------ invalidate


def _invalidate_args() -> dict:
    return dict(device_global_indices=torch.zeros(3, 4, dtype=i32),
                request_state_indices=torch.zeros(2, dtype=i32),
                req_id_per_token=torch.zeros(5, dtype=i32),
                written_slots=torch.zeros(5, dtype=i64))


INVALIDATE = {
    "device_global_indices dtype": Check(
        _to("device_global_indices", i64),
        "device_global_indices must be a contiguous 2D int32 CUDA tensor",
        "device_global_indices"),
    "device_global_indices contiguous": Check(
        _strided("device_global_indices"),
        "device_global_indices must be a contiguous 2D int32 CUDA tensor",
        "device_global_indices"),
    "request_state_indices dtype": Check(
        _to("request_state_indices", i64),
        "request_state_indices must be a contiguous 1D int32 CUDA tensor",
        "request_state_indices"),
    "req_id_per_token 1-D": Check(
        _set(req_id_per_token=lambda a: a["req_id_per_token"].view(5, 1)),
        "req_id_per_token must be a contiguous 1D int32 CUDA tensor", "req_id_per_token"),
    "written_slots dtype": Check(_to("written_slots", i32),
                                 "written_slots must be a contiguous 1D int64 CUDA tensor",
                                 "written_slots"),
    "written_slots contiguous": Check(_strided("written_slots"),
                                      "written_slots must be a contiguous 1D int64 CUDA tensor",
                                      "written_slots"),
    "equal length": Check(_cut("written_slots", rows=4),
                          "req_id_per_token and written_slots must have equal length",
                          "written_slots 4"),
    "one device": Check(_meta("req_id_per_token"),
                        "HiSparse invalidation tensors must be on the same CUDA device",
                        "req_id_per_token is on meta"),
}


# ------------------------------------------------------------------------------ FP8 gather


def _upconvert_args() -> dict:
    z = lambda *shape: torch.zeros(shape, dtype=i32)  # noqa: E731
    return dict(src_cache=torch.zeros(6, 4, 656, dtype=torch.uint8),
                dst=torch.zeros(20, 576, dtype=torch.bfloat16), block_table=z(3, 4),
                workspace_starts=z(3), batch_size=3, seq_starts=z(3),
                host_cache=_host(30, 656), host_row_ids=z(1, 20), device_row_ids=z(1, 20))


def _odd_rows(a: dict) -> torch.Tensor:
    """src_cache rows 657 B apart (not 4-byte aligned)."""
    return torch.zeros(6 * 4 * 657, dtype=torch.uint8).as_strided((6, 4, 656), (4 * 657, 657, 1))


UPCONVERT = {
    "block_table dtype": Check(_to("block_table", i64), "block_table must be int32",
                               "block_table"),
    "block_table row-major": Check(_column_major("block_table"), None,
                                   "block_table must be row-major"),
    "src_cache device": Check(_meta("src_cache"),
                              "src_cache and block_table must be on the same device",
                              "src_cache is on meta"),
    "src_cache dtype": Check(_to("src_cache", torch.float16),
                             "src_cache must be uint8, float8_e4m3fn, or float8_e5m2",
                             "torch.float16"),
    "src_cache rows of 656 B": Check(_set(src_cache=torch.zeros(6, 4, 576, dtype=torch.uint8)),
                                     None, "src_cache must be [num_blocks, block_size, 656]"),
    "src_cache rows 4-byte aligned": Check(_set(src_cache=_odd_rows), None,
                                           "src_cache rows must be 4-byte aligned"),
    "src_cache address 4-byte aligned": Check(
        _set(src_cache=lambda a: torch.zeros(6 * 4 * 656 + 1, dtype=torch.uint8)[1:].view(
            6, 4, 656)), None, "must be 4-byte aligned"),
    "dst dtype": Check(_to("dst", torch.float32), "dst must be bfloat16", "dst"),
    "dst device": Check(_meta("dst"), "src_cache and dst must be on the same device",
                        "dst is on meta"),
    "dst head_dim": Check(_cut("dst", cols=512), "head_dim must be 576 for MLA",
                          "512 values"),
    "dst rows contiguous": Check(_strided("dst"), None, "dst rows must be contiguous"),
    "workspace_starts dtype": Check(_to("workspace_starts", i64),
                                    "workspace_starts must be int32", "workspace_starts"),
    "workspace_starts device": Check(
        _meta("workspace_starts"), "src_cache and workspace_starts must be on the same device",
        "workspace_starts is on meta"),
    "batch_size non-negative": Check(_set(batch_size=-1), None, "batch_size"),
    "batch_size within the tables": Check(_set(batch_size=4), None, "batch_size 4"),
    "seq_starts dtype": Check(_to("seq_starts", i64), "seq_starts must be int32",
                              "seq_starts"),
    "seq_starts device": Check(_meta("seq_starts"),
                               "src_cache and seq_starts must be on the same device",
                               "seq_starts is on meta"),
    "seq_starts per request": Check(_cut("seq_starts", rows=2), None, "seq_starts has 2"),
    "host_cache with host_row_ids": Check(_set(host_row_ids=None, device_row_ids=None), None,
                                          "host_cache and host_row_ids"),
    "device_row_ids with host rows": Check(_set(host_cache=None, host_row_ids=None), None,
                                           "device_row_ids needs host_cache"),
    **_host_cache_checks(656, vllm=False),
    "host_cache of bytes": Check(_set(host_cache=torch.zeros(30, 328, dtype=torch.bfloat16)),
                                 None, "host_cache must hold bytes"),
    "host_row_ids dtype": Check(_to("host_row_ids", i64), None, "host_row_ids"),
    "device_row_ids per host row": Check(_cut("device_row_ids", cols=19), None,
                                         "device_row_ids has 19 entries"),
}


# ------------------------------------------------------------------------------ the tests


OPS = {
    "hisparse_resolve_residency": (_resolve_args, RESOLVE),
    "hisparse_gather_plan": (_plan_args, GATHER_PLAN),
    "hisparse_gather_compact": (_compact_args, GATHER_COMPACT),
    "hisparse_invalidate_written_slots": (_invalidate_args, INVALIDATE),
    "cp_gather_and_upconvert_fp8_kv_cache": (_upconvert_args, UPCONVERT),
}
CASES = [(op, name) for op, (_, checks) in OPS.items() for name in checks]


@pytest.fixture(scope="module", autouse=True)
def registered():
    assert plugin.register() is True


def _implementation(how: str, op: str) -> Callable[..., None]:
    if how == "torch":
        return getattr(vllm_reference, op)
    if how == "triton":
        return plugin.DEFINITIONS[op].triton
    return getattr(torch.ops._C_cache_ops, op)


@pytest.mark.parametrize("op,name", CASES, ids=[f"{op}-{name}" for op, name in CASES])
@pytest.mark.parametrize("how", ["torch", "triton", "dispatcher"])
def test_every_check_raises_runtime_error_with_vllms_message(op, name, how, monkeypatch):
    build, checks = OPS[op]
    check = checks[name]
    valid = build()
    before = {k: v.clone() for k, v in valid.items() if isinstance(v, torch.Tensor)}
    args = dict(valid)
    check.mutate(args)
    if how == "dispatcher":
        if any(isinstance(v, torch.Tensor) and v.device.type == "meta" for v in args.values()):
            pytest.skip("the dispatcher sends a call with a meta tensor to the fake kernel")
        monkeypatch.setenv("HISPARSE_TRITON_BACKEND", "torch")
    with pytest.raises(RuntimeError) as caught:
        _implementation(how, op)(*args.values())
    message = str(caught.value)
    assert message.startswith(f"{op}: "), message
    if check.vllm is not None:
        assert re.search(re.escape(check.vllm), message), message
    assert check.names in message, message
    for key, tensor in before.items():   # the valid arguments, untouched
        assert torch.equal(valid[key], tensor), key


def test_every_valid_argument_set_is_accepted():
    """The base cases are valid (so each refusal above is its mutation's)."""
    for op, (build, _) in OPS.items():
        getattr(vllm_reference, op)(*build().values())
        plugin.DEFINITIONS[op].triton(*build().values())


def test_the_launch_grid_limit_of_the_invalidation(monkeypatch):
    """vLLM refuses more tokens than a grid dimension holds (2**31 - 1): the same check,
    shown with the limit lowered (a real 2**31-token call needs 16 GiB)."""
    monkeypatch.setattr(vllm_checks, "_INT32_MAX", 4)
    with pytest.raises(RuntimeError, match="HiSparse invalidation grid exceeds CUDA limits"):
        vllm_reference.hisparse_invalidate_written_slots(*_invalidate_args().values())


def test_an_unpinned_host_cache_is_refused_for_a_cuda_launch():
    """vLLM: ``host_cache must be pinned CPU memory``. Our CUDA launchers read the host cache
    in place; the check runs before anything is launched."""
    from hisparse_triton.kernels import vllm_residency

    with pytest.raises(RuntimeError, match="hisparse_gather_plan: host_cache must be pinned "
                                           "CPU memory: .* not pinned"):
        vllm_residency._check_host_cache("hisparse_gather_plan", _host(),
                                         torch.device("cuda"))
