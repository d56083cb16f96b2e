"""``docs/api.md`` documents every public name of the runtime's classes.

The classes are introspected (methods, properties, class and instance attributes of a small
live instance), so a public name added later fails here until its class's section of the
reference names it; and every method the reference lists as a call must exist."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from hisparse_triton import (
    EngineConfig,
    HiSparseConfig,
    HiSparseRuntime,
    HiSparseScheduler,
    HiSparseWorker,
)
from hisparse_triton.layout import get_hisparse_kv_cache_config, get_hisparse_kv_cache_groups
from hisparse_triton.presets import build_kv_cache_spec
from hisparse_triton.runtime import HiSparseStats
from hisparse_triton.scheduler import SchedulerStats
from hisparse_triton.worker import WorkerStats

DOC = Path(__file__).resolve().parent.parent / "docs" / "api.md"


def sections(text: str) -> dict[str, str]:
    """``{heading: body}`` of every ``## `` section (backticks dropped from the heading)."""
    out: dict[str, str] = {}
    current = None
    for line in text.splitlines():
        if line.startswith("## "):
            current = line[3:].strip().strip("`")
            out[current] = ""
        elif current is not None:
            out[current] += line + "\n"
    return out


def documented(body: str) -> set[str]:
    """Names written in backticks (``name``, ``name(...)``, ``Class.name(...)``)."""
    return set(re.findall(r"`(?:[A-Za-z_]\w*\.)*([A-Za-z_]\w*)", body))


def listed_calls(body: str) -> set[str]:
    """Names a bullet lists as a call: ``- `name(...)``."""
    return set(re.findall(r"^- `(?:[A-Za-z_]\w*\.)*([A-Za-z_]\w*)\(", body, flags=re.M))


def public(obj: object) -> set[str]:
    return {name for name in dir(obj) if not name.startswith("_")}


@pytest.fixture(scope="module")
def live():
    """A scheduler, a worker and a facade on the CPU (tiny preset), and one plan."""
    spec = build_kv_cache_spec("tiny")
    config = EngineConfig(max_model_len=512, num_gpu_blocks_override=64,
                          hisparse=HiSparseConfig(index_topk=32, host_pool_gib=0.01))
    groups = get_hisparse_kv_cache_groups(config, spec)
    kv = get_hisparse_kv_cache_config(config, groups, available_memory=0,
                                      host_budget=config.hisparse.host_pool_bytes)
    scheduler = HiSparseScheduler(kv, config, max_num_seqs=2)
    worker = HiSparseWorker(kv, config, max_num_seqs=2, device="cpu")
    runtime = HiSparseRuntime(kv, config, max_num_seqs=2, device="cpu")
    objects = {"HiSparseScheduler": scheduler, "HiSparseWorker": worker,
               "HiSparseRuntime": runtime, "StepPlan": scheduler.step()}
    yield objects
    worker.close()
    runtime.close()


@pytest.fixture(scope="module")
def doc():
    return sections(DOC.read_text(encoding="utf-8"))


@pytest.mark.parametrize("name", ["HiSparseScheduler", "StepPlan", "HiSparseWorker",
                                  "HiSparseRuntime"])
def test_every_public_name_is_documented(name, live, doc):
    assert name in doc, f"docs/api.md has no section '## `{name}`'"
    missing = sorted(public(live[name]) - documented(doc[name]))
    assert not missing, (f"public names of {name} missing from its section of docs/api.md: "
                         f"{missing}; document each (shapes, dtypes, errors, when to call)")


@pytest.mark.parametrize("name", ["HiSparseScheduler", "StepPlan", "HiSparseWorker",
                                  "HiSparseRuntime"])
def test_every_documented_call_exists(name, live, doc):
    stale = sorted(listed_calls(doc[name]) - public(live[name]) - {name})
    assert not stale, f"docs/api.md lists calls {name} does not have: {stale}"


def test_the_statistics_are_documented(doc):
    body = doc["Statistics"]
    for cls in (SchedulerStats, WorkerStats, HiSparseStats):
        names = {f.name for f in dataclasses.fields(cls)} | {
            n for n, v in vars(cls).items() if isinstance(v, property)}
        missing = sorted(names - documented(body))
        assert not missing, f"{cls.__name__} fields missing from docs/api.md: {missing}"


def test_the_reference_states_the_rules(doc):
    assert "The step order, as rules" in doc
    assert "Capacity and backpressure" in doc
    body = doc["Capacity and backpressure"]
    for text in ("At admission", "At append", "Defer the chunk", "Preempt",
                 "concurrent prefill chunks", "vLLM's per-step budget"):
        assert text in body, text
