"""Set-up for the tests that drive vLLM 0.33.0's own HiSparse classes.

vLLM is not a dependency of this project. Its Python sources import on a CPU machine from the
separate venv that ``.ci/vllm_venv.sh`` makes; tests marked ``needs_vllm`` skip elsewhere, with
the command that makes the venv. ``HISPARSE_TRITON_REQUIRE_VLLM=1`` (set by ``.ci/run``) turns
that skip into a failure, so CI never passes them by skipping.

Without a GPU, vLLM switches its own Triton kernels off unless ``CUDA_VISIBLE_DEVICES`` is
empty (it then takes the process for a worker whose device is not up yet); the empty value
lets vLLM's index-conversion kernel run in the Triton interpreter like ours. It is set before
the first vLLM import and only on machines without CUDA.
"""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", "")

REQUIRE_VLLM_ENV = "HISPARSE_TRITON_REQUIRE_VLLM"
VLLM_VERSION = "0.33.0"
MAKE_VENV = ("make the CPU venv with `bash .ci/vllm_venv.sh`, then run "
             "`.venv-vllm/bin/python -m pytest tests/integrations/vllm`")


def _vllm_version() -> str | None:
    if importlib.util.find_spec("vllm") is None:
        return None
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("vllm")
    except PackageNotFoundError:
        return None


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", f"needs_vllm: drives vLLM {VLLM_VERSION}'s own classes (skipped without it)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    found = _vllm_version()
    if found == VLLM_VERSION:
        return
    why = (f"vLLM {VLLM_VERSION} is not importable here (found: {found or 'none'}); "
           f"{MAKE_VENV}")
    needing = [item for item in items if item.get_closest_marker("needs_vllm") is not None]
    if needing and os.environ.get(REQUIRE_VLLM_ENV) == "1":
        raise pytest.UsageError(f"{REQUIRE_VLLM_ENV}=1 but {why}")
    for item in needing:
        item.add_marker(pytest.mark.skip(reason=why))
