"""vLLM 0.33's HiSparse custom ops on hisparse-triton's kernels: ``register()``.

vLLM 0.33.0 runs its HiSparse data plane through five ops it looks up under
``torch.ops._C_cache_ops``: ``hisparse_resolve_residency``, ``hisparse_gather_compact``,
``hisparse_gather_plan``, ``hisparse_invalidate_written_slots`` and
``cp_gather_and_upconvert_fp8_kv_cache`` (with the host-row arguments of the prefill staging
path). Its own implementations exist only in its CUDA build. ``register()`` defines them with
vLLM's names, schemas (argument order, defaults, mutated arguments) and semantics
(``hisparse_triton.integrations.vllm_reference``), so vLLM's HiSparse runs on these kernels
unchanged:

- vLLM's compiled ops win: an op vLLM already provides is left alone (with all five present
  and no override, ``register()`` changes nothing), unless overridden
  (``HISPARSE_TRITON_VLLM_OVERRIDE`` or ``register(override=...)``): ``1`` / ``hisparse``
  replaces the CPU and CUDA kernels of vLLM's four ``hisparse_*`` ops (for A/B runs against
  vLLM's CUDA ops) and keeps its ``cp_gather_and_upconvert_fp8_kv_cache``, which vLLM's FP8
  MLA prefill also runs without HiSparse; ``all`` replaces that one too;
- ``register()`` refuses, with a logged reason, to register anything (returns ``False``)
  when the running vLLM is not a 0.33 release or an op vLLM already has differs from 0.33's
  schema: these ops implement 0.33's semantics;
- each call runs on the backend ``HISPARSE_TRITON_BACKEND`` names (``auto``: Triton on CUDA
  tensors, the torch models on CPU ones; ``triton``; ``torch``), read at every call;
- fake (meta) kernels let ``torch.compile`` and CUDA-graph capture trace the ops; the schema
  marks every argument an op writes.

The ops are registered by ``hisparse_triton.ops.registry.register_family`` (family ``vllm``
of ``hisparse_triton.ops.OP_TABLE``) with vLLM's schema text, ``on_existing="keep"`` (or
``"replace"`` for the overridden ones) and the backend chosen per call from the op's index
tensors.

``register()`` returns whether ours serve the four ``hisparse_*`` ops (what vLLM checks before
it starts HiSparse) and logs the providers (or the refusal) once; ``providers()`` says which
implementation each op has. Calling it again is cheap and safe. This module never imports vLLM; when vLLM's
compiled extension is installed but not loaded yet, its library is loaded first (so its own
ops are seen and never redefined).
"""

from __future__ import annotations

import glob
import importlib.metadata
import importlib.util
import logging
import os
import re
import sys
from typing import Any, Callable, Optional, Union

import torch

from hisparse_triton.integrations import vllm_reference
from hisparse_triton.ops import registry
from hisparse_triton.ops.registry import OpDefinition

__all__ = ["DEFINITIONS", "FAMILY", "HISPARSE_OPS", "NAMESPACE", "OP_NAMES", "OVERRIDES",
           "OVERRIDE_ENV", "SCHEMAS", "VLLM_RELEASE", "providers", "register"]

logger = logging.getLogger(__name__)

#: The op namespace vLLM calls.
NAMESPACE = "_C_cache_ops"
#: Environment variable that puts ours in place of vLLM's own ops (see ``OVERRIDES``).
OVERRIDE_ENV = "HISPARSE_TRITON_VLLM_OVERRIDE"
#: The ops vLLM 0.33 requires before it starts HiSparse (``_has_hisparse_ops``).
HISPARSE_OPS = ("hisparse_resolve_residency", "hisparse_invalidate_written_slots",
                "hisparse_gather_plan", "hisparse_gather_compact")
#: Every op defined here.
OP_NAMES = HISPARSE_OPS + ("cp_gather_and_upconvert_fp8_kv_cache",)
#: Override value -> the ops of vLLM's own that ours replace: none (unset, ``""``, ``0``), the
#: four HiSparse ops (``1``, ``hisparse``), or all five (``all``: also the FP8 up-convert that
#: vLLM's FP8 MLA prefill runs without HiSparse).
OVERRIDES = {"": (), "0": (), "1": HISPARSE_OPS, "hisparse": HISPARSE_OPS, "all": OP_NAMES}
#: The vLLM release (major, minor) whose ops, schemas and semantics these are.
VLLM_RELEASE = (0, 33)

#: vLLM 0.33.0's schemas, verbatim (argument names, order, defaults, aliasing).
SCHEMAS = {
    "hisparse_resolve_residency": (
        "hisparse_resolve_residency(Tensor host_cache, Tensor! hot_cache, "
        "Tensor hot_block_table, Tensor global_indices, Tensor! hot_indices, "
        "Tensor! device_global_indices, Tensor! lru_slots, Tensor? request_state_indices, "
        "int region_stride, int max_union_rows, Tensor(a!)? miss_mask=None, "
        "Tensor(b!)? stats=None, Tensor(c!)? attention_indices=None, "
        "int attention_block_stride=0, Tensor? request_ids=None, "
        "Tensor? source_block_table=None, int source_block_size=0, "
        "Tensor(d!)? resolved_global_indices=None, Tensor(e!)? valid_counts=None, "
        "Tensor(f!)? swap_host_physical_rows=None, Tensor(g!)? swap_device_physical_rows=None, "
        "Tensor(h!)? swap_counts=None, Tensor? resident_block_table=None, "
        "int resident_block_size=0, int resident_null_block=0) -> ()"),
    "hisparse_invalidate_written_slots": (
        "hisparse_invalidate_written_slots(Tensor! device_global_indices, "
        "Tensor request_state_indices, Tensor req_id_per_token, Tensor written_slots) -> ()"),
    "hisparse_gather_plan": (
        "hisparse_gather_plan(Tensor host_cache, Tensor! hot_cache, Tensor global_indices, "
        "Tensor hot_indices, Tensor miss_mask, Tensor? request_state_indices, "
        "Tensor(a!)? attention_indices=None, int attention_block_stride=0) -> ()"),
    "hisparse_gather_compact": (
        "hisparse_gather_compact(Tensor host_cache, Tensor! hot_cache, "
        "Tensor miss_global_indices, Tensor miss_hot_indices, Tensor miss_counts) -> ()"),
    "cp_gather_and_upconvert_fp8_kv_cache": (
        "cp_gather_and_upconvert_fp8_kv_cache(Tensor src_cache, Tensor! dst, "
        "Tensor block_table, Tensor workspace_starts, int batch_size, Tensor? seq_starts, "
        "Tensor? host_cache=None, Tensor? host_row_ids=None, "
        "Tensor? device_row_ids=None) -> ()"),
}


def _launcher(module: str, name: str) -> Callable[..., None]:
    """The Triton launcher ``hisparse_triton.kernels.<module>.<name>``, imported at its first
    call (Triton is never imported for the torch backend)."""
    found: list[Callable[..., None]] = []

    def launch(*args: Any) -> None:
        if not found:
            found.append(getattr(importlib.import_module(f"hisparse_triton.kernels.{module}"),
                                 name))
        return found[0](*args)

    launch.__name__ = f"{name}_triton"
    return launch


def _fake(*args: Any) -> None:
    """Fake (meta) kernel of every op: they return nothing and write their ``Tensor!`` args."""
    return None


def _definition(name: str, kernel_module: str, backend_arg: str) -> OpDefinition:
    """One op: vLLM's schema, our torch model and Triton launcher, the backend picked at every
    call from the device of ``backend_arg`` (the op's index tensors)."""
    return OpDefinition(name, reference=getattr(vllm_reference, name),
                        triton=_launcher(kernel_module, name), fake=_fake,
                        schema=SCHEMAS[name], backend_arg=backend_arg)


#: The family name of these ops in ``hisparse_triton.ops.OP_TABLE``.
FAMILY = "vllm"
#: op name -> its ``OpDefinition`` (``register()`` registers them).
DEFINITIONS = {
    "hisparse_resolve_residency": _definition(
        "hisparse_resolve_residency", "vllm_residency", "global_indices"),
    "hisparse_invalidate_written_slots": _definition(
        "hisparse_invalidate_written_slots", "vllm_residency", "device_global_indices"),
    "hisparse_gather_plan": _definition("hisparse_gather_plan", "vllm_gather", "global_indices"),
    "hisparse_gather_compact": _definition(
        "hisparse_gather_compact", "vllm_gather", "miss_global_indices"),
    "cp_gather_and_upconvert_fp8_kv_cache": _definition(
        "cp_gather_and_upconvert_fp8_kv_cache", "vllm_fp8", "block_table"),
}

#: op name -> "hisparse_triton" (ours serve it) or "vllm" (vLLM's own), for ops seen so far.
_PROVIDERS: dict[str, str] = {}
_LOGGED: list[bool] = []
#: Why ``register()`` refused (once per process: the running vLLM does not change).
_REFUSED: list[str] = []


def _load_vllm_extension() -> None:
    """Load vLLM's compiled ops library when it is installed but not loaded yet, so that its
    own ops are seen (and never redefined here). Imports no vLLM Python module."""
    if any(m in sys.modules for m in ("vllm._C_stable_libtorch", "vllm._C")):
        return
    try:
        spec = importlib.util.find_spec("vllm")
    except (ImportError, ValueError):
        return
    if spec is None or not spec.submodule_search_locations:
        return
    for folder in spec.submodule_search_locations:
        for pattern in ("_C_stable_libtorch*.so", "_C.*.so"):
            for path in sorted(glob.glob(os.path.join(folder, pattern))):
                try:
                    torch.ops.load_library(path)
                except (OSError, RuntimeError) as error:
                    logger.debug("vLLM's ops library %s did not load (%s); its ops are "
                                 "absent here", path, error)


def _overridden(override: Union[bool, str]) -> tuple[str, ...]:
    """The ops of vLLM's own that ours replace: ``override`` (``True`` = ``"hisparse"``), or
    when it is ``False`` the environment's ``OVERRIDE_ENV`` (``OVERRIDES``)."""
    if override is True:
        return OVERRIDES["hisparse"]
    where = "register(override=...)"
    if override is False:
        override, where = os.environ.get(OVERRIDE_ENV, ""), OVERRIDE_ENV
    value = override.strip().lower() if isinstance(override, str) else override
    if value not in OVERRIDES:
        raise ValueError(f"{where} must be one of {', '.join(repr(v) for v in OVERRIDES)} "
                         f"(or, for register, True / False), got {override!r}")
    return OVERRIDES[value]


def _running_vllm_version() -> Optional[str]:
    """The version of the vLLM running here: its module's ``__version__`` when it is
    imported (vLLM's plugin loader is part of it), else its installed distribution's; None
    without vLLM. Imports no vLLM module."""
    version = getattr(sys.modules.get("vllm"), "__version__", None)
    if isinstance(version, str):
        return version
    try:
        return importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return None


def _refusal() -> Optional[str]:
    """Why these ops must not be registered here, or None: the running vLLM is not a 0.33
    release, or an op it already has (its compiled extension's) has another schema than
    0.33's. Ops this module registered are ours and skipped."""
    version = _running_vllm_version()
    if version is not None:
        found = re.match(r"(\d+)\.(\d+)(?!\d)", version)
        if found is None or (int(found[1]), int(found[2])) != VLLM_RELEASE:
            return (f"vLLM {version} is running, but these ops implement vLLM "
                    f"{'.'.join(map(str, VLLM_RELEASE))}'s schemas and semantics")
    for name in OP_NAMES:
        qualname = f"{NAMESPACE}::{name}"
        if qualname in registry.OP_TABLE:
            continue
        try:
            theirs = torch._C._dispatch_find_schema_or_throw(qualname, "").schema()
        except RuntimeError:
            continue  # vLLM does not have it: ours may define it
        ours = torch._C.parse_schema(f"{qualname}{SCHEMAS[name][len(name):]}")
        if str(theirs) != str(ours):
            return f"vLLM's {qualname} has the schema {theirs}, not vLLM 0.33's {ours}"
    return None


def register(override: Union[bool, str] = False) -> bool:
    """Provide vLLM 0.33's HiSparse ops under ``torch.ops._C_cache_ops`` (see the module
    docstring). ``override``: ``False`` (the default: ``HISPARSE_TRITON_VLLM_OVERRIDE``
    decides), ``True`` or ``"hisparse"`` (ours replace vLLM's four ``hisparse_*`` ops),
    ``"all"`` (and its FP8 up-convert); a bad value raises ``ValueError``. Returns whether
    ours serve the four ``hisparse_*`` ops: ``False`` also when the running vLLM is not 0.33
    or one of its ops has another schema (nothing is registered then; the reason is logged
    once as a warning). Logs the providers once."""
    replaced = _overridden(override)
    if _REFUSED:
        return False
    if any(name not in _PROVIDERS for name in OP_NAMES):
        _load_vllm_extension()
    if not _PROVIDERS:
        reason = _refusal()
        if reason is not None:
            _REFUSED.append(reason)
            logger.warning("vLLM HiSparse ops: hisparse-triton registers none (%s); vLLM's own "
                           "ops, if it has them, stay", reason)
            return False
    changed = False
    for on_existing in ("replace", "keep"):
        pending = [DEFINITIONS[name] for name in OP_NAMES
                   if (name in replaced) == (on_existing == "replace")
                   and (_PROVIDERS.get(name) is None
                        or (_PROVIDERS[name] == "vllm" and name in replaced))]
        if not pending:
            continue
        done = registry.register_family(FAMILY, pending, namespace=NAMESPACE,
                                        on_existing=on_existing)
        for name, outcome in done.outcomes.items():
            _PROVIDERS[name] = "vllm" if outcome == "kept" else "hisparse_triton"
        changed = changed or done.changed
    active = all(_PROVIDERS[name] == "hisparse_triton" for name in HISPARSE_OPS)
    if changed or not _LOGGED:
        ours = [n for n in OP_NAMES if _PROVIDERS[n] == "hisparse_triton"]
        theirs = [n for n in OP_NAMES if _PROVIDERS[n] == "vllm"]
        logger.info("vLLM HiSparse ops: %s (hisparse-triton: %s; vLLM: %s)",
                    "hisparse-triton" if active else "vLLM", ", ".join(ours) or "none",
                    ", ".join(theirs) or "none")
        _LOGGED.append(True)
    return active


def providers() -> dict[str, Optional[str]]:
    """Op name -> ``"hisparse_triton"`` / ``"vllm"`` (``None``: ``register()`` not called, or
    it refused)."""
    return {name: _PROVIDERS.get(name) for name in OP_NAMES}
