"""Register an op family with ``torch.library`` and record it in the op table.

An op family (``hisparse_triton.ops.<family>``) has, for each of its ops, a pure-torch
reference and a Triton implementation of one contract. ``register_family`` turns each op into
the custom op ``<namespace>::<name>``, so that ``torch.compile`` and ``torch.export`` trace it
as one opaque node, and records it in ``OP_TABLE``. An ``OpDefinition`` says what to register:

- ``reference``: the CPU kernel. Its parameters and type annotations are the op's schema
  (inferred by ``torch.library.infer_schema``): ``Tensor``, ``Optional[Tensor]``, ``int``,
  ``float``, ``bool``, ``list[int]``, ...; it returns ``None``, a ``Tensor`` or a tuple of
  tensors. Custom ops take tensors and scalars only: richer arguments travel flattened (a
  ``RowTable`` as its pool and its host-side numbers) and are rebuilt inside the kernel.
- ``triton``: the CUDA kernel, with exactly the reference's parameter names, in order.
- ``fake``: the shapes-only kernel ``torch.compile`` runs on fake tensors: called
  positionally with the schema's arguments, it returns new empty outputs of the right shapes
  and dtypes (``t.new_empty(...)``) and reads no value; ``None`` for an op without outputs.
- ``mutates_args``: every parameter the op writes in place. Tracing relies on it: a write to
  an undeclared argument can be dropped or reordered. Outputs must be fresh tensors (never
  an input or a view of one).

Contract of ``register_family(family, definitions, namespace=...)``:

- Everything is checked before ``torch.library`` is touched: the family, namespace and op
  names are identifiers; no op name is given twice, already in ``OP_TABLE`` or already known
  to torch; every ``mutates_args`` entry names a parameter; every reference parameter and its
  return are annotated and the schema infers; ``triton`` has the reference's parameters;
  ``fake`` accepts them positionally. A refused call raises ``ValueError`` (``TypeError`` for
  something that is not an ``OpDefinition`` or not callable) naming the bad value, and
  registers nothing.
- On success every op is registered (CPU kernel = reference, CUDA kernel = triton, fake
  kernel = fake, the declared mutations) and recorded in ``OP_TABLE`` as
  ``"<namespace>::<name>" -> RegisteredOp``; the custom ops are returned by name, in the
  order given (``torch.ops.<namespace>.<name>`` is the same op).
- The same definitions may be registered under several namespaces: each registration is its
  own custom op with its own table entry. A registration lasts for the process (torch has no
  public way to remove one), so register at import time, once.
- It only registers. When a call goes through the custom op is the caller's choice (the ops
  of ``hisparse_triton.ops`` skip it for eager calls).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable, Mapping, Sequence

import torch

__all__ = ["NAMESPACE", "OP_TABLE", "OpDefinition", "RegisteredOp", "register_family"]

#: The namespace of this package's ops: ``torch.ops.hisparse_triton.<name>``.
NAMESPACE = "hisparse_triton"


@dataclass(frozen=True)
class OpDefinition:
    """One op of a family: what ``register_family`` registers (see the module docstring)."""

    name: str
    reference: Callable[..., Any]
    triton: Callable[..., Any]
    fake: Callable[..., Any]
    mutates_args: tuple[str, ...] = ()


@dataclass(frozen=True)
class RegisteredOp:
    """An entry of ``OP_TABLE``: a custom op, the family it belongs to and its definition."""

    namespace: str
    family: str
    definition: OpDefinition
    op: Any  # torch.library.CustomOpDef: call it like the reference

    @property
    def qualname(self) -> str:
        """``"<namespace>::<name>"``, the key of this entry."""
        return f"{self.namespace}::{self.definition.name}"


_TABLE: dict[str, RegisteredOp] = {}
#: Every op registered by ``register_family``: ``"<namespace>::<name>" -> RegisteredOp``
#: (read-only).
OP_TABLE: Mapping[str, RegisteredOp] = MappingProxyType(_TABLE)


def register_family(family: str, definitions: Sequence[OpDefinition], *,
                    namespace: str = NAMESPACE) -> dict[str, Any]:
    """Register the ops of ``family`` as ``<namespace>::<name>`` custom ops (CPU: reference,
    CUDA: triton, fake kernel, declared mutations) and record them in ``OP_TABLE``.

    Returns ``{name: custom op}`` in the order of ``definitions``. Checks everything first
    and raises ``ValueError`` / ``TypeError`` naming the bad value without registering
    anything (the full contract is in the module docstring).
    """
    _check_identifier("family", family)
    _check_identifier("namespace", namespace)
    definitions = tuple(definitions)
    if not definitions:
        raise ValueError(f"register_family: family {family!r} has no op definitions")
    seen: set[str] = set()
    for definition in definitions:
        _check_definition(definition, namespace)
        if definition.name in seen:
            raise ValueError(f"register_family: op {definition.name!r} is given twice in "
                             f"family {family!r}")
        seen.add(definition.name)

    registered: dict[str, Any] = {}
    for definition in definitions:
        registered[definition.name] = _register(definition, namespace)
    for definition in definitions:  # recorded only once every op is registered
        entry = RegisteredOp(namespace, family, definition, registered[definition.name])
        _TABLE[entry.qualname] = entry
    return registered


def _check_identifier(what: str, value: object) -> None:
    if not isinstance(value, str) or not value.isidentifier():
        raise ValueError(f"register_family: {what} must be a Python identifier, got {value!r}")


def _check_definition(definition: OpDefinition, namespace: str) -> None:
    """Every rule of the module docstring for one definition; raises naming the bad value."""
    if not isinstance(definition, OpDefinition):
        raise TypeError(f"register_family: expected OpDefinition, got "
                        f"{type(definition).__name__}")
    name = definition.name
    _check_identifier("op name", name)
    qualname = f"{namespace}::{name}"
    if qualname in _TABLE:
        raise ValueError(f"register_family: {qualname} is already registered (family "
                         f"{_TABLE[qualname].family!r})")
    if _known_to_torch(namespace, name):
        raise ValueError(f"register_family: torch already has an op {qualname}")
    for role in ("reference", "triton", "fake"):
        if not callable(getattr(definition, role)):
            raise TypeError(f"register_family: {qualname}: {role} must be callable, got "
                            f"{type(getattr(definition, role)).__name__}")
    reference = inspect.signature(definition.reference)
    params = tuple(reference.parameters)
    unannotated = [p for p, v in reference.parameters.items() if v.annotation is v.empty]
    if unannotated or reference.return_annotation is reference.empty:
        what = f"parameters {unannotated}" if unannotated else "the return"
        raise ValueError(f"register_family: {qualname}: the reference must annotate every "
                         f"parameter and its return (they are the schema); {what} has none")
    mutates = definition.mutates_args
    if isinstance(mutates, str) or not all(isinstance(m, str) for m in mutates):
        raise ValueError(f"register_family: {qualname}: mutates_args must be a tuple of "
                         f"parameter names, got {mutates!r}")
    unknown = [m for m in mutates if m not in params]
    if unknown:
        raise ValueError(f"register_family: {qualname}: mutates_args names {unknown}, which "
                         f"are not parameters of the reference {list(params)}")
    triton_params = tuple(inspect.signature(definition.triton).parameters)
    if triton_params != params:
        raise ValueError(f"register_family: {qualname}: the triton kernel takes "
                         f"{list(triton_params)}, the reference {list(params)}; they must match")
    try:
        inspect.signature(definition.fake).bind(*params)
    except TypeError as exc:
        raise ValueError(f"register_family: {qualname}: the fake kernel cannot take the "
                         f"{len(params)} arguments {list(params)} positionally ({exc})") from None
    try:
        torch.library.infer_schema(definition.reference, mutates_args=mutates)
    except (ValueError, TypeError) as exc:
        raise ValueError(f"register_family: {qualname}: no schema from the reference: "
                         f"{exc}") from exc


def _known_to_torch(namespace: str, name: str) -> bool:
    try:
        getattr(getattr(torch.ops, namespace), name)
    except (AttributeError, RuntimeError):
        return False
    return True


def _register(definition: OpDefinition, namespace: str) -> Any:
    op = torch.library.custom_op(f"{namespace}::{definition.name}", definition.reference,
                                 mutates_args=definition.mutates_args, device_types="cpu")
    op.register_kernel("cuda")(definition.triton)
    op.register_fake(definition.fake)
    return op
