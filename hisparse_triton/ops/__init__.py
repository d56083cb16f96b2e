"""Public ops (``resolve``, ``copy_rows``, ``copy_pages``, ``plan_prefill``,
``stage_prefill``) and their backend dispatch.

Also re-exported here: ``ResolveWorkspace`` (reusable outputs and scratch of ``resolve``),
``restore_resolve_state`` (undo the last ``resolve`` made with a workspace) and
``PrefillWorkspace`` (the buffers of ``plan_prefill``).

Each op has the signature of its torch reference (``ops.<family>.reference``) plus a keyword
``backend``:

- ``"auto"``: the Triton kernels when the op's tensors are on CUDA, the torch reference
  otherwise;
- ``"triton"``: the Triton kernels; on CPU tensors only under ``TRITON_INTERPRET=1`` (the
  interpreter, for tests), else ``BackendUnavailableError`` (never a silent fallback);
- ``"torch"``: the reference on whatever device the tensors are;
- ``None``: ``$HISPARSE_TRITON_BACKEND`` (read at every call), default ``"auto"``.

The op's device is the device of its index tensors (``topk``; ``src_rows`` / ``src_blocks``):
the device the kernels run on. Pools may be elsewhere (a pinned CPU host pool on CUDA).

The ops are also registered as ``torch.library`` custom ops under the ``hisparse_triton``
namespace (``torch.ops.hisparse_triton.{resolve,copy_rows,copy_pages,plan_prefill}``,
registered by ``registry.register_family`` and listed in ``OP_TABLE``): CPU kernel = the
reference, CUDA kernel = Triton, fake kernels for ``torch.compile`` (fixed output shapes; the
copy ops declare the destination pool mutated, ``resolve`` declares ``slot_host_rows`` and
``lru`` mutated, ``plan_prefill`` mutates nothing).
Custom ops take tensors and scalars only, so a ``RowTable`` travels flattened as ``(pool,
offsets, row_bytes, block_size, block_stride, num_rows)`` (``flat_table``) with ``offsets`` a
list of ints (the table's own copy: the op rebuilds the table without reading a device
tensor).

Eager calls (plain tensors, no ``torch.compile`` / export tracing, no dispatch mode) skip the
``torch.library`` dispatch and call the chosen implementation directly: the dispatcher adds a
few microseconds of host time per call (it boxes every argument and calls back into Python),
which the eager path saves. Traced calls go through the registered
op so that ``torch.compile`` sees one opaque node. There, ``torch`` runs the registered op only
when every tensor is on the CPU (the op's CUDA kernel is Triton: a CPU plan over a CUDA pool
would reach it) and calls the reference directly otherwise; ``triton`` on CPU (the
interpreter) calls the kernel launcher directly.

``validate_table`` checks a table for a device (alignment, pinning for a CUDA kernel); the
kernels do it on first use otherwise. A ``RowTable`` checks its layers against its pool when
it is built, from its own copy of the offsets.

Layout: one sub-package per op family, each holding every part of its ops except the
``@triton.jit`` kernels, which live beside it in ``hisparse_triton.kernels.<family>``:

- ``<family>/contract.py``: the result types and argument checks, shared by the reference
  and the Triton launchers (the kernels import the contract, never the reference);
- ``<family>/reference.py``: the pure-torch definition: the bit-exact oracle of the kernels
  and the ``torch`` backend;
- ``<family>/op.py``: the public functions (backend choice, eager bypass, traced path) and
  the family's ``registry.OpDefinition``s, registered at import;
- ``<family>/workspace.py`` where a family reuses buffers across calls.

Families: ``resolve`` (kernels: ``kernels.resolve``), ``copy`` (``copy_rows`` /
``copy_pages``; kernels: ``kernels.gather`` and ``kernels.backup``) and ``prefill``
(``plan_prefill`` / ``stage_prefill``: a prefill chunk's rows with its host-only rows staged;
kernels: ``kernels.prefill``). Shared parts:
``backends.py`` (backend names, ``select_backend``, ``is_eager``, ``plain_dispatch``) and ``registry.py`` (the
one ``torch.library`` registration helper and the op table).

``hisparse_triton.ops.resolve`` is the op (the function, exported here); its family package is
reached with the ``from`` form, e.g. ``from hisparse_triton.ops.resolve import reference``.
"""

from __future__ import annotations

from hisparse_triton.ops import registry
from hisparse_triton.ops.backends import (
    BACKENDS,
    ENV_VAR,
    BackendUnavailableError,
    is_eager,
    plain_dispatch,
    select_backend,
)
from hisparse_triton.ops.copy.op import (
    copy_pages,
    copy_pages_op,
    copy_rows,
    copy_rows_op,
    flat_table,
    validate_table,
)
from hisparse_triton.ops.prefill.contract import PrefillPlan
from hisparse_triton.ops.prefill.op import plan_prefill, plan_prefill_op, stage_prefill
from hisparse_triton.ops.prefill.workspace import PrefillWorkspace
from hisparse_triton.ops.registry import OP_TABLE
from hisparse_triton.ops.resolve.contract import ResolveResult
from hisparse_triton.ops.resolve.op import resolve, resolve_op
from hisparse_triton.ops.resolve.workspace import ResolveWorkspace, restore_resolve_state

__all__ = ["BACKENDS", "ENV_VAR", "OP_TABLE", "BackendUnavailableError", "PrefillPlan",
           "PrefillWorkspace", "ResolveResult", "ResolveWorkspace", "copy_pages",
           "copy_pages_op", "copy_rows", "copy_rows_op", "flat_table", "is_eager",
           "plain_dispatch", "plan_prefill", "plan_prefill_op", "resolve", "resolve_op",
           "restore_resolve_state", "select_backend", "stage_prefill", "validate_table"]

# Short names the tests use.
_eager = is_eager
_flat = flat_table
