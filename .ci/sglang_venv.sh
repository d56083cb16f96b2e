#!/usr/bin/env bash
# Make a separate virtual environment in which SGLang 0.5.23's Python sources import on CPU, for
# the tests in tests/integrations/sglang/ that drive SGLang's own HiSparse classes.
#
# SGLang's wheel is downloaded once (kept in the cache folder below and reused), unpacked
# WITHOUT its dependencies or compiled extensions (*.so) and put on sys.path with a .pth file
# (its dist-info comes along, so its version and SGLang's plugin loader see it); the
# pure-Python packages its modules import come from .ci/sglang-cpu-requirements.txt; torch
# (CPU), triton and this project (editable, so its `sglang.srt.plugins` entry point is
# installed) are installed pinned, as in the main venv. SGLang never becomes a dependency of
# the product.
#
#   bash .ci/sglang_venv.sh            # makes .venv-sglang/ (or $HISPARSE_SGLANG_VENV)
#   .venv-sglang/bin/python -m pytest -q tests/integrations/sglang
#
# Environment: HISPARSE_SGLANG_VENV (venv folder, default .venv-sglang), HISPARSE_SGLANG_CACHE
# (wheel cache, default ${XDG_CACHE_HOME:-~/.cache}/hisparse-triton).
set -euo pipefail
cd "$(dirname "$0")/.."
start=$SECONDS
sglang_version=0.5.23
venv=${HISPARSE_SGLANG_VENV:-.venv-sglang}
cache=${HISPARSE_SGLANG_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/hisparse-triton}

stack_venv_after_install() {
    # Hugging Face's `kernels` package (which SGLang declares, and transformers imports when
    # it is installed) has the import name of this repository's kernels/ folder, which
    # `python -m pytest` puts on sys.path: keep it out. SGLang's CPU imports do not need it.
    "$1/bin/pip" uninstall --quiet --yes kernels 2>/dev/null || true
}
source .ci/stack_venv.sh
make_stack_venv sglang "$sglang_version" "$venv" "$cache"

# The modules the tests drive, with the test stubs in place; a missing package fails here,
# with its name.
PYTHONPATH=tests/integrations/sglang "$venv/bin/python" - <<'PY'
import importlib

import sglang_stubs

sglang_stubs.install()
for name in (
    "sglang.srt.plugins",
    "sglang.srt.plugins.hook_registry",
    "sglang.kernels.ops.kvcache.hisparse",
    "sglang.srt.managers.hisparse_coordinator",
    "sglang.srt.mem_cache.allocator.hisparse",
    "sglang.srt.mem_cache.hisparse_memory_pool",
    "sglang.srt.mem_cache.memory_pool",
    "sglang.srt.mem_cache.pool_host.mla",
):
    importlib.import_module(name)
from importlib.metadata import version

print(f"sglang venv: SGLang {version('sglang')} imports from "
      f"{importlib.import_module('sglang').__path__[0]}")
PY
echo "sglang venv: ready in $((SECONDS - start)) s"
