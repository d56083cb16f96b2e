"""SGLang 0.5.23's HiSparse swap-in on hisparse-triton's kernels: ``register()``.

SGLang runs its HiSparse decode through functions of ``sglang.kernels.ops.kvcache.hisparse``
that its ``HiSparseCoordinator`` imports by name. ``register()`` (the ``sglang.srt.plugins``
entry point ``hisparse_triton``) asks SGLang's ``HookRegistry`` to REPLACE two of them with
the functions of this module, which have SGLang's exact signatures, argument conventions and
in-place outputs (semantics: ``hisparse_triton.integrations.sglang_reference``):

- ``load_cache_to_device_buffer_mla``: the swap-in of one layer (resolve the top-k positions
  against the request's hot buffer, update the slot table and the LRU, record the miss plan
  when asked, copy the missed rows host -> device);
- ``copy_cache_planned_mla``: a follower layer's replay of its leader's miss plan.

SGLang's ``load_plugins()`` calls ``register()`` early in every process and then
``HookRegistry.apply_hooks()``, which swaps the functions in SGLang's module and in every
module that imported them (the coordinator included). Not replaced, and logged once: the MTP
verify swap-in ``load_cache_to_device_buffer_spec_mla`` (a CLOCK cache with sampled victims
and racing admission, which cannot be matched bit for bit), DeepSeek-V4's swap-in
``load_cache_to_device_buffer_dsv4_mla`` and the page-padded replay
(``copy_cache_planned_mla(is_dsv4_layout=True)`` calls SGLang's own), MiniMax's block swap-in.

Each call runs on the backend ``HISPARSE_TRITON_BACKEND`` names, read at every call: ``auto``
(the Triton kernels on CUDA tensors, the torch models on CPU ones), ``triton`` or ``torch``.
A swap-in whose ``num_top_k`` is over ``MAX_TOP_K`` runs on SGLang's own kernel on the Triton
backend (logged once).

``register()`` checks SGLang's version and the replaced functions' signatures first; on any
mismatch it logs the reason, replaces nothing and returns False. It returns True when the
hooks are registered (calling it again is cheap and registers nothing twice); ``providers()``
says which implementation serves each function. Importing this module never imports SGLang.
"""

from __future__ import annotations

import importlib
import inspect
import logging
from typing import Any, Callable, Optional

from hisparse_triton.integrations import sglang_reference
from hisparse_triton.integrations.sglang_checks import MAX_TOP_K
from hisparse_triton.ops.backends import select_backend

__all__ = ["MAX_TOP_K", "NOT_REPLACED", "REPLACED", "SGLANG_VERSION", "TARGET_MODULE",
           "copy_cache_planned_mla", "load_cache_to_device_buffer_mla", "providers", "refusal",
           "register"]

logger = logging.getLogger(__name__)

#: The SGLang release whose functions are replaced (any other is refused).
SGLANG_VERSION = "0.5.23"
#: The module that defines the replaced functions.
TARGET_MODULE = "sglang.kernels.ops.kvcache.hisparse"


def _signature(kind: str, required: tuple[str, ...], defaults: tuple[tuple[str, Any], ...]
               ) -> tuple[tuple[str, str, Any], ...]:
    return tuple((name, kind, inspect.Parameter.empty) for name in required) \
        + tuple((name, kind, default) for name, default in defaults)


#: Replaced functions -> SGLang 0.5.23's parameters: (name, kind, default) in order.
REPLACED: dict[str, tuple[tuple[str, str, Any], ...]] = {
    "load_cache_to_device_buffer_mla": _signature(
        "POSITIONAL_OR_KEYWORD",
        ("top_k_tokens", "device_buffer_tokens", "host_cache_locs", "device_buffer_locs",
         "host_cache", "device_buffer", "top_k_device_locs", "req_pool_indices", "seq_lens",
         "lru_slots", "item_size_bytes", "num_top_k", "hot_buffer_size"),
        (("page_size", 1), ("block_size", 256), ("num_real_reqs", None), ("miss_src", None),
         ("miss_dst", None), ("miss_count", None), ("skip_io", False))),
    "copy_cache_planned_mla": _signature(
        "KEYWORD_ONLY",
        ("miss_src", "miss_dst", "miss_count", "num_real_reqs", "host_cache", "device_buffer",
         "item_size_bytes"),
        (("num_blocks", 4), ("block_size", 1024), ("is_dsv4_layout", False),
         ("skip_io", False))),
}
#: SGLang's HiSparse functions this plugin leaves to SGLang, and why.
NOT_REPLACED = {
    "load_cache_to_device_buffer_spec_mla": "the MTP verify swap-in keeps a CLOCK cache with "
    "sampled victims and racing admission that cannot be matched bit for bit",
    "load_cache_to_device_buffer_dsv4_mla": "DeepSeek-V4's page-padded C4 layout",
    "load_blocks_to_device_buffer_mha": "MiniMax M3's block-selected MHA swap-in",
}

_ORIGINALS: dict[str, Callable[..., Any]] = {}
_REGISTERED: list[bool] = []
_NOTED: set[str] = set()


def _note_once(key: str, message: str, *args: Any) -> None:
    if key not in _NOTED:
        _NOTED.add(key)
        logger.info(message, *args)


def _parameters(fn: Callable[..., Any]) -> tuple[tuple[str, str, Any], ...]:
    return tuple((p.name, p.kind.name, p.default)
                 for p in inspect.signature(fn).parameters.values())


def refusal() -> Optional[str]:
    """Why ``register()`` would refuse this environment (None: it would not): SGLang missing
    or not 0.5.23, its plugin registry or a replaced function missing, or a replaced
    function's parameters (names, order, kinds, defaults) not SGLang 0.5.23's."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("sglang")
    except PackageNotFoundError:
        return "SGLang is not installed"
    if found != SGLANG_VERSION:
        return f"SGLang {found} is installed; this plugin matches SGLang {SGLANG_VERSION} only"
    try:
        registry = importlib.import_module("sglang.srt.plugins.hook_registry")
        module = importlib.import_module(TARGET_MODULE)
    except Exception as error:  # noqa: BLE001 - any import failure is a reason to refuse
        return f"SGLang's modules do not import ({type(error).__name__}: {error})"
    if not hasattr(registry, "HookRegistry") or not hasattr(getattr(registry, "HookType", None),
                                                            "REPLACE"):
        return "sglang.srt.plugins.hook_registry has no HookRegistry / HookType.REPLACE"
    for name, expected in REPLACED.items():
        fn = getattr(module, name, None)
        if not callable(fn):
            return f"{TARGET_MODULE}.{name} is missing"
        got = _parameters(inspect.unwrap(fn))
        if got != expected:
            return (f"{TARGET_MODULE}.{name} has parameters {[p[0] for p in got]} with kinds "
                    f"/ defaults that differ from SGLang {SGLANG_VERSION}'s")
    return None


def register() -> bool:
    """Register the REPLACE hooks with SGLang's ``HookRegistry`` (see the module docstring);
    SGLang's ``load_plugins()`` applies them. Returns True when they are registered, False
    (with a logged reason, nothing registered) when SGLang is not 0.5.23 or a signature
    differs. Calling it again registers nothing twice."""
    if _REGISTERED:
        return True
    reason = refusal()
    if reason is not None:
        logger.warning("hisparse-triton's SGLang plugin replaces nothing: %s", reason)
        return False
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    module = importlib.import_module(TARGET_MODULE)
    for name in REPLACED:
        _ORIGINALS[name] = inspect.unwrap(getattr(module, name))
    HookRegistry.register(f"{TARGET_MODULE}.load_cache_to_device_buffer_mla",
                          load_cache_to_device_buffer_mla, HookType.REPLACE)
    HookRegistry.register(f"{TARGET_MODULE}.copy_cache_planned_mla", copy_cache_planned_mla,
                          HookType.REPLACE)
    _REGISTERED.append(True)
    logger.info("SGLang HiSparse: %s on hisparse-triton; left to SGLang: %s",
                ", ".join(REPLACED), "; ".join(f"{k} ({v})" for k, v in NOT_REPLACED.items()))
    return True


def providers() -> dict[str, Optional[str]]:
    """Function name -> ``"hisparse_triton"`` (ours are registered) or None (``register()``
    not called or refused), for the replaced functions; ``"sglang"`` for the ones left to
    SGLang."""
    ours = "hisparse_triton" if _REGISTERED else None
    return {**{name: ours for name in REPLACED}, **{name: "sglang" for name in NOT_REPLACED}}


def _original(name: str) -> Callable[..., Any]:
    fn = _ORIGINALS.get(name)
    if fn is None:
        fn = _ORIGINALS[name] = inspect.unwrap(
            getattr(importlib.import_module(TARGET_MODULE), name))
    return fn


def _kernels():
    from hisparse_triton.kernels import sglang_swap_in

    return sglang_swap_in


def load_cache_to_device_buffer_mla(
        top_k_tokens, device_buffer_tokens, host_cache_locs, device_buffer_locs, host_cache,
        device_buffer, top_k_device_locs, req_pool_indices, seq_lens, lru_slots,
        item_size_bytes, num_top_k, hot_buffer_size, page_size=1, block_size=256,
        num_real_reqs=None, miss_src=None, miss_dst=None, miss_count=None,
        skip_io=False) -> None:
    """SGLang's ``load_cache_to_device_buffer_mla`` on hisparse-triton: the Triton kernels
    (``kernels.sglang_swap_in``: one resolve launch, one copy launch) or the torch model
    (``sglang_reference``), per ``HISPARSE_TRITON_BACKEND`` and the tensors' device."""
    args = (top_k_tokens, device_buffer_tokens, host_cache_locs, device_buffer_locs,
            host_cache, device_buffer, top_k_device_locs, req_pool_indices, seq_lens,
            lru_slots, item_size_bytes, num_top_k, hot_buffer_size, page_size, block_size,
            num_real_reqs, miss_src, miss_dst, miss_count, skip_io)
    if select_backend(None, top_k_tokens.device) == "torch":
        return sglang_reference.load_cache_to_device_buffer_mla(*args)
    if isinstance(num_top_k, int) and num_top_k > MAX_TOP_K:
        _note_once("top_k", "SGLang HiSparse: num_top_k=%d is over %d; this swap-in runs on "
                   "SGLang's own kernel", num_top_k, MAX_TOP_K)
        return _original("load_cache_to_device_buffer_mla")(*args)
    return _kernels().load_cache_to_device_buffer_mla(*args)


def copy_cache_planned_mla(*, miss_src, miss_dst, miss_count, num_real_reqs, host_cache,
                           device_buffer, item_size_bytes, num_blocks=4, block_size=1024,
                           is_dsv4_layout=False, skip_io=False) -> None:
    """SGLang's ``copy_cache_planned_mla`` on hisparse-triton (one Triton launch, or the torch
    model); DeepSeek-V4's page-padded layout (``is_dsv4_layout=True``) runs SGLang's own."""
    kwargs = dict(miss_src=miss_src, miss_dst=miss_dst, miss_count=miss_count,
                  num_real_reqs=num_real_reqs, host_cache=host_cache,
                  device_buffer=device_buffer, item_size_bytes=item_size_bytes,
                  num_blocks=num_blocks, block_size=block_size, is_dsv4_layout=is_dsv4_layout,
                  skip_io=skip_io)
    if is_dsv4_layout:
        return _original("copy_cache_planned_mla")(**kwargs)
    if select_backend(None, miss_src.device) == "torch":
        return sglang_reference.copy_cache_planned_mla(**kwargs)
    return _kernels().copy_cache_planned_mla(**kwargs)
