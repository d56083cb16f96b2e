"""A failed facade call changes nothing while table changes wait to be handed over.

With a change pending, the facade's resolve calls and ``commit()`` hand a plan to the worker
before they do their own work. Every check that can be made is made first (a bad leader or
top-k, a top-k on a device the worker cannot read, a ``stream`` that is not one); what can
only fail later (a prefill chunk that overflows the staging region, torch raising) reverts
the hand-over. Checked three ways, each against the whole state (``_debug_snapshot()``:
both halves' tables, the pending plan, the read holds; ``stats()``: counters and plans
applied; ``step_count``):

- calls refused by a check or by the staging capacity;
- a fault injected at every line the call runs in the worker and the ops
  (``fault_points.sweep``);
- torch itself raising at every torch call the call makes (a ``TorchFunctionMode`` that
  raises at its k-th call, for k = 1, 2, ... until the call completes).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

import pytest
import torch
from torch.overrides import TorchFunctionMode

from hisparse_triton import HiSparseRuntime
from hisparse_triton.errors import PrefillStagingError, ReservationExceededError
from hisparse_triton.oracle import DenseOracle
from hisparse_triton.presets import build_kv_cache_spec
from hisparse_triton.workload import plan_for_workload
from tests.fault_points import sweep

B, TOPK = 4, 8
PACKAGE = Path(__file__).resolve().parent.parent / "hisparse_triton"
#: Fault points: every line of the worker and what it runs (ops, kernels' launchers,
#: staging), where torch or a check can raise. Not the facade's own lines (they only order
#: the calls into the halves: torch raising in those is the torch sweep below) nor the
#: scheduler's (no torch; its calls roll back through the journal, swept in its own tests).
WHERE = tuple(str(path) for path in sorted(PACKAGE.rglob("*.py"))
              if path.name != "runtime.py" and "scheduler" not in path.parts)


def make_runtime(staging_rows: int = 8) -> HiSparseRuntime:
    """4 sparse layers (two index groups), block 4, top-k 8, watermark 1.0 (committed pages
    leave the GPU at once, so prefill chunks reference host-only rows), a staging region of
    8 rows (a chunk can overflow it; 0: staging blocks lent per step)."""
    plan = plan_for_workload(build_kv_cache_spec("tiny", num_layers=4, block_size=B),
                             max_model_len=64, num_requests=3, topk=TOPK,
                             device_buffer_size=2 * TOPK, max_num_batched_tokens=16)
    hisparse = dataclasses.replace(plan.config.hisparse, prefill_staging_rows=staging_rows)
    config = dataclasses.replace(plan.config, hisparse=hisparse)
    return HiSparseRuntime(plan.kv_cache_config, config, max_num_seqs=3, device="cpu",
                           backend="torch", free_block_watermark=1.0)


def make_pending(staging_rows: int):
    """A runtime whose requests ``a`` (32 tokens) and ``b`` (8) are committed, then each
    appended one token: those changes wait for the next plan."""
    rt = make_runtime(staging_rows)
    oracle = DenseOracle(rt, seed=1)
    for rid, n in (("a", 32), ("b", 8)):
        rt.add_request(rid, n, 8)
        oracle.add(rid)
        for start in range(0, n, 16):
            oracle.write(rid, rt.append_slots(rid, min(16, n - start)))
            rt.commit()
    for rid in ("a", "b"):
        oracle.write(rid, rt.append_slots(rid, 1))
    assert rt.scheduler.has_pending_changes
    return rt, oracle


@pytest.fixture
def pending():
    """``make_pending`` with a staging region of 8 rows."""
    rt, oracle = make_pending(8)
    yield rt, oracle
    rt.close()


@pytest.fixture
def pending_lent():
    """``make_pending`` with the default staging: blocks lent per step."""
    rt, oracle = make_pending(0)
    yield rt, oracle
    rt.close()


def state(rt: HiSparseRuntime):
    return rt._debug_snapshot(), rt.stats(), rt.scheduler.step_count


L0 = "model.layers.0.self_attn.attn"


def topk_of(*lengths: int) -> torch.Tensor:
    """``[len(lengths), K]`` positions, row ``i`` spread over ``lengths[i]`` tokens."""
    return torch.stack([torch.arange(TOPK) * (n // TOPK) for n in lengths]).to(torch.int32)


def calls(rt: HiSparseRuntime) -> dict[str, Callable[[], object]]:
    """The facade's calls that change state, each valid on the ``pending`` runtime."""
    rows = rt.state_rows(["a", "b"])
    chunk = torch.arange(2 * TOPK).view(2, TOPK) % 8      # 8 distinct rows: fits
    return {
        "resolve": lambda: rt.resolve(L0, ["a", "b"], topk_of(33, 9)),
        "resolve_rows": lambda: rt.resolve_rows(L0, rows, topk_of(33, 9)),
        "resolve_rows_stream": lambda: rt.resolve_rows(L0, rows, topk_of(33, 9),
                                                      stream=torch.cpu.Stream()),
        "resolve_prefill": lambda: rt.resolve_prefill(L0, ["a", "a"], chunk),
        "commit": rt.commit,
        "flush": rt.flush,
        "append_slots": lambda: rt.append_slots("a", 3),
        "append_drafts": lambda: rt.append_slots("a", 3, num_draft_tokens=2),
        "add_request": lambda: rt.add_request("c", 4, 4),
        "truncate": lambda: rt.truncate("a", 32),
        "free_request": lambda: rt.free_request("b"),
    }


# ---------------------------------------------------------------------- refused calls
def test_refused_calls_with_a_change_pending_change_nothing(pending) -> None:
    rt, _ = pending
    rows = rt.state_rows(["a", "b"])
    over = torch.arange(2 * TOPK).view(2, TOPK)            # 16 host-only rows: 8 fit
    refused = [
        (lambda: rt.resolve_prefill(L0, ["a", "a"], over), PrefillStagingError,
         "holds 8"),
        (lambda: rt.resolve_prefill(L0, ["a", "a"], over.to("meta")), ValueError, "meta"),
        (lambda: rt.resolve_prefill(L0, ["a"], over[:1].float()), ValueError, "integer"),
        (lambda: rt.resolve_rows(L0, rows, topk_of(33, 9), stream="not a stream"),
         ValueError, "stream must be"),
        (lambda: rt.resolve_rows(L0, rows, topk_of(33, 9).to("meta")), ValueError, "meta"),
        (lambda: rt.resolve(L0, ["a", "b"], topk_of(33, 9).float()), ValueError, "integer"),
        (lambda: rt.resolve("model.layers.1.self_attn.attn", ["a"], topk_of(33)),
         ValueError, "leader"),
        (lambda: rt.append_slots("a", 100), ReservationExceededError, "reservation"),
    ]
    for call, error, match in refused:
        before = state(rt)
        with pytest.raises(error, match=match):
            call()
        assert state(rt) == before, f"a refused call ({error.__name__}) changed state"
        assert rt.scheduler.has_pending_changes


def test_the_runtime_is_exact_after_refused_calls(pending) -> None:
    rt, oracle = pending
    with pytest.raises(PrefillStagingError):
        rt.resolve_prefill(L0, ["a", "a"], torch.arange(2 * TOPK).view(2, TOPK))
    with pytest.raises(ValueError):
        rt.resolve_rows(L0, rt.state_rows(["a"]), topk_of(33), stream=object())
    for leader in rt.leaders:
        topk = topk_of(33, 9)
        oracle.check_resolve(leader, ["a", "b"], topk, rt.resolve(leader, ["a", "b"], topk))
    rt.commit()


# ---------------------------------------------------------------------- line faults
@pytest.mark.parametrize("name", ["resolve", "resolve_rows", "resolve_rows_stream",
                                  "resolve_prefill", "commit", "flush", "append_slots",
                                  "append_drafts"])
def test_a_fault_at_any_line_of_a_facade_call_changes_nothing(pending, name) -> None:
    rt, _ = pending
    call = calls(rt)[name]
    points = sweep(call, lambda: state(rt), where=WHERE)
    assert points > 5


# ---------------------------------------------------------------------- torch raising
class InjectedTorchError(RuntimeError):
    """What the k-th torch call raises."""


class FailAt(TorchFunctionMode):
    """Raise ``InjectedTorchError`` at the ``k``-th torch function or tensor method call."""

    def __init__(self, k: int) -> None:
        super().__init__()
        self.k, self.seen = k, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.seen += 1
        if self.seen == self.k:
            raise InjectedTorchError(f"torch call {self.k} ({getattr(func, '__name__', func)})")
        return func(*args, **(kwargs or {}))


def torch_sweep(rt: HiSparseRuntime, name: str, call: Callable[[], object]) -> None:
    """Torch raises at the k-th call of ``call``, k = 1, 2, ...: nothing changes each time."""
    before = state(rt)
    for k in range(1, 100_000):
        mode = FailAt(k)
        try:
            with mode:
                call()
        except InjectedTorchError:
            assert state(rt) == before, f"torch raising at call {k} of {name} changed state"
            continue
        break
    assert k > 3, f"{name} made only {k - 1} torch calls"


@pytest.mark.parametrize("name", ["resolve", "resolve_rows", "resolve_rows_stream",
                                  "resolve_prefill", "commit", "flush", "append_slots",
                                  "append_drafts"])
def test_torch_raising_at_any_call_changes_nothing(pending, name) -> None:
    rt, _ = pending
    torch_sweep(rt, name, calls(rt)[name])


# ---------------------------------------------------------------------- async rollback
@pytest.fixture
def verified():
    """Async scheduling on ``make_pending``'s runtime: ``a`` appends the last token and 2
    drafts, commits, appends the next step's 3 tokens (2 drafts) before the verification,
    then hears that none of the first drafts was accepted: the pending plan carries the
    freed pages, the hot slots to empty and the re-mirror of every moved position."""
    rt, _ = make_pending(8)
    rt.commit()
    rt.append_slots("a", 3, num_draft_tokens=2)
    rt.commit()
    rt.append_slots("a", 3, num_draft_tokens=2)
    rt.verify_drafts("a", 0)
    assert rt.pending_drafts("a") == [(35, 2)] and rt.scheduler.has_pending_changes
    yield rt
    rt.close()


def verified_calls(rt: HiSparseRuntime) -> dict[str, Callable[[], object]]:
    return {"resolve": lambda: rt.resolve(L0, ["a", "b"], topk_of(36, 9)),
            "commit": rt.commit, "flush": rt.flush}


@pytest.mark.parametrize("name", ["resolve", "commit", "flush"])
def test_a_fault_handing_over_a_verification_changes_nothing(verified, name) -> None:
    rt = verified
    assert sweep(verified_calls(rt)[name], lambda: state(rt), where=WHERE) > 5


@pytest.mark.parametrize("name", ["resolve", "commit", "flush"])
def test_torch_raising_handing_over_a_verification_changes_nothing(verified, name) -> None:
    torch_sweep(verified, name, verified_calls(verified)[name])


# ---------------------------------------------------------------------- lent staging rows
def test_faults_while_staging_rows_are_lent_change_nothing(pending_lent) -> None:
    """The default staging: ``resolve_prefill`` holds the chunk's requests, borrows blocks
    for the step (a journaled allocation), hands the plan over and stages; a fault at any
    worker line, or torch raising at any call, undoes all of it."""
    rt, oracle = pending_lent
    chunk = torch.arange(2 * TOPK).view(2, TOPK)           # 16 host-only rows
    call = lambda: rt.resolve_prefill(L0, ["a", "a"], chunk)  # noqa: E731
    before = state(rt)
    for k in range(1, 100_000):
        try:
            with FailAt(k):
                call()
        except InjectedTorchError:
            assert state(rt) == before, f"torch raising at call {k} changed state"
            continue
        break
    assert k > 3
    rt.commit()                          # the blocks go back
    assert not rt.scheduler.read_holds.lent_blocks()
    rt.scheduler.check_invariants()
    oracle.write("b", rt.append_slots("b", 1))      # a change waits again
    assert sweep(call, lambda: state(rt), where=WHERE) > 5
    assert rt.scheduler.read_holds.lent_blocks()             # the last run borrowed
    oracle.check_resolve(L0, ["a", "a"], chunk, call())
