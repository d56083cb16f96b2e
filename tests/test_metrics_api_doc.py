"""``docs/api.md`` documents every public name of ``hisparse_triton.metrics`` (its classes
introspected on live instances, as ``test_api_doc.py`` does for the runtime's classes) and
the worker's ``GroupCounts``."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_api_doc import DOC, documented, public, sections

import hisparse_triton.metrics as metrics_package
from hisparse_triton.metrics import (
    Deployment,
    HiSparseMetrics,
    Observation,
    StepTimer,
    StepTimes,
    VerdictSettings,
)
from hisparse_triton.metrics.sampler import MetricsSample
from hisparse_triton.metrics.verdict import Verdict
from hisparse_triton.presets import build_kv_cache_spec
from hisparse_triton.runtime import HiSparseRuntime
from hisparse_triton.worker.stats import GroupCounts
from hisparse_triton.workload import plan_for_workload

SECTION = "hisparse_triton.metrics"


@pytest.fixture(scope="module")
def body():
    return sections(DOC.read_text(encoding="utf-8"))[SECTION]


@pytest.fixture(scope="module")
def live():
    spec = build_kv_cache_spec("tiny", num_layers=4, block_size=4)
    plan = plan_for_workload(spec, max_model_len=64, num_requests=1, topk=8,
                             device_buffer_size=16)
    runtime = HiSparseRuntime(plan.kv_cache_config, plan.config, max_num_seqs=1,
                              device="cpu", backend="torch")
    yield HiSparseMetrics(runtime, verdict=VerdictSettings(preset="tiny"))
    runtime.close()


def fields(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)} | {
        n for n, v in vars(cls).items() if isinstance(v, property) or (
            callable(v) and not n.startswith("_")) or isinstance(v, classmethod)}


def test_the_package_names_are_documented(body):
    missing = sorted(set(metrics_package.__all__) - documented(body))
    assert not missing, f"hisparse_triton.metrics names missing from docs/api.md: {missing}"


def test_the_live_objects_are_documented(live, body):
    prom = pytest.importorskip("prometheus_client", reason="the metrics extra is not installed")
    from hisparse_triton.metrics import MetricsServer

    objects = {"HiSparseMetrics": live, "StepTimer": StepTimer(torch.device("cpu")),
               "HiSparseCollector": live.collector()}
    with MetricsServer(live) as server:
        objects["MetricsServer"] = server
        for name, obj in objects.items():
            missing = sorted(public(obj) - documented(body))
            assert not missing, f"public names of {name} missing from docs/api.md: {missing}"
    assert prom is not None


@pytest.mark.parametrize("cls", [MetricsSample, Verdict, VerdictSettings, Deployment,
                                 Observation, StepTimes])
def test_the_records_are_documented(cls, body):
    missing = sorted(fields(cls) - documented(body))
    assert not missing, f"{cls.__name__} fields missing from docs/api.md: {missing}"


def test_group_counts_are_documented():
    body = sections(DOC.read_text(encoding="utf-8"))["Statistics"]
    missing = sorted(fields(GroupCounts) - documented(body))
    assert not missing, f"GroupCounts fields missing from docs/api.md: {missing}"
