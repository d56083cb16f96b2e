#!/usr/bin/env bash
# Make a separate virtual environment in which vLLM 0.33.0's Python sources import on CPU, for
# the tests in tests/integrations/vllm/ that drive vLLM's own HiSparse classes.
#
# vLLM's wheel is downloaded once (kept in the cache folder below and reused), unpacked
# WITHOUT its compiled extensions (*.so: CUDA-only) and put on sys.path with a .pth file; the
# pure-Python packages its modules import come from .ci/vllm-cpu-requirements.txt; torch (CPU),
# triton and this project (editable) are installed pinned, as in the main venv. vLLM never
# becomes a dependency of the product.
#
#   bash .ci/vllm_venv.sh            # makes .venv-vllm/ (or $HISPARSE_VLLM_VENV)
#   .venv-vllm/bin/python -m pytest -q tests/integrations/vllm
#
# Environment: HISPARSE_VLLM_VENV (venv folder, default .venv-vllm), HISPARSE_VLLM_CACHE
# (wheel cache, default ${XDG_CACHE_HOME:-~/.cache}/hisparse-triton).
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
vllm_version=0.33.0
venv=${HISPARSE_VLLM_VENV:-.venv-vllm}
cache=${HISPARSE_VLLM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hisparse-triton}

source .ci/stack_venv.sh
make_stack_venv vllm "$vllm_version" "$venv" "$cache"

# The modules the tests drive; a missing package fails here, with its name.
"$venv/bin/python" - <<'PY'
import importlib

import vllm

for name in (
    "vllm.plugins",
    "vllm.v1.core.kv_cache_manager",
    "vllm.v1.core.sched.scheduler",
    "vllm.v1.hisparse.binding",
    "vllm.v1.hisparse.coordinator",
    "vllm.v1.hisparse.layout",
    "vllm.v1.hisparse.runtime",
    "vllm.v1.attention.backends.mla.index_group",
    "vllm.distributed.kv_transfer.kv_connector.v1.hisparse.connector",
):
    importlib.import_module(name)
print(f"vllm venv: vLLM {vllm.__version__} imports from {vllm.__path__[0]}")
PY
echo "vllm venv: ready in $((SECONDS - start)) s"
