"""Test setup: run Triton kernels in the interpreter when there is no GPU.

``TRITON_INTERPRET`` must be set before any module with ``@triton.jit`` is imported, so it is
set here, at collection start.
"""

import os
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


@pytest.fixture
def kernel_device() -> torch.device:
    """Where kernel tests put their tensors: CUDA when present, else CPU (interpreter)."""
    return torch.device("cuda" if HAS_CUDA and not INTERPRET else "cpu")
