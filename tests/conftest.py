"""Test setup: run Triton kernels in the interpreter when there is no GPU.

``TRITON_INTERPRET`` must be set before any module with ``@triton.jit`` is imported, so it is
set here, at collection start.
"""

import os
from pathlib import Path
import sys

import torch

# The lab that measures the project (``bench/lab``, not installed) is imported as ``lab``.
BENCH_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
if BENCH_DIR not in sys.path:
    sys.path.insert(0, BENCH_DIR)

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

# Small CPU ops are dominated by OpenMP start-up on a 2-core machine; one thread keeps the
# interpreter-driven tests fast and their timing stable.
torch.set_num_threads(1)

HAS_CUDA = torch.cuda.is_available()
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
ROOT = Path(__file__).resolve().parent.parent

#: The kernel and op tests, marked ``kernels`` (a file or one test of it): every kernel and op
#: against its reference under the interpreter, the readers of compiled output (SASS model,
#: AMD code) and ``simulate --backend triton``. CI runs them (``pytest -m kernels``) on every
#: declared Triton besides the one the full suite runs on (.ci/run).
KERNEL_TESTS = (
    "tests/test_backup_kernel.py",
    "tests/test_gather_kernel.py",
    "tests/test_ops.py",
    "tests/test_resolve_kernel.py",
    "tests/test_resolve_hash.py",
    "tests/test_resolve_policy.py",
    "tests/test_resolve_api.py",
    "tests/test_resolve_sass_model.py",
    "tests/test_prefill_ops.py",
    "tests/test_prefill_staging.py",
    "tests/test_amd_targets.py",
    "tests/test_cli_simulate.py::test_triton_backend",
    "tests/integrations/vllm/test_ops_gather.py",
    "tests/integrations/vllm/test_ops_resolve.py",
    "tests/integrations/vllm/test_ops_fp8.py",
    "tests/integrations/vllm/test_ops_invalidate.py",
)


def pytest_configure(config: pytest.Config) -> None:
    missing = [entry for entry in KERNEL_TESTS
               if not (ROOT / entry.split("::")[0]).is_file()]
    if missing:
        raise pytest.UsageError(f"KERNEL_TESTS in tests/conftest.py names missing files: "
                                f"{', '.join(missing)}")


def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    for item in items:
        test = item.nodeid.split("[")[0]  # without the parameters
        if test in KERNEL_TESTS or test.split("::")[0] in KERNEL_TESTS:
            item.add_marker(pytest.mark.kernels)


@pytest.fixture
def kernel_device() -> torch.device:
    """Where kernel tests put their tensors: CUDA when present, else CPU (interpreter)."""
    return torch.device("cuda" if HAS_CUDA and not INTERPRET else "cpu")
