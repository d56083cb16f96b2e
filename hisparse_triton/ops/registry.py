"""Register ops with ``torch.library`` and record them in the op table.

One helper, ``register_family``, registers every op this package provides: its own op
families (``hisparse_triton.ops.<family>``, namespace ``hisparse_triton``) and the ops an
integration provides under another project's names (vLLM's ``_C_cache_ops``). Each op becomes
``torch.ops.<namespace>.<name>``, traced by ``torch.compile`` / ``make_fx`` / export as one
opaque node, and is recorded in ``OP_TABLE``. Registration goes through
``torch.library.Library`` (``define`` + ``impl`` per dispatch key + ``register_fake``), not
``torch.library.custom_op``: a call then costs the C++ dispatcher plus the kernel, without
custom_op's Python wrappers (tens to hundreds of microseconds per call for many arguments).

An ``OpDefinition`` says what to register:

- ``reference``: the pure-torch kernel. Without ``schema`` its parameters and type
  annotations are the op's schema (``torch.library.infer_schema``): ``Tensor``,
  ``Optional[Tensor]``, ``int``, ``float``, ``bool``, ``list[int]``, ...; it returns ``None``,
  a ``Tensor`` or a tuple of tensors. Ops take tensors and scalars only: richer arguments
  travel flattened (a ``RowTable`` as its pool and its host-side numbers) and are rebuilt
  inside the kernel.
- ``triton``: the Triton kernel (its launcher), with the schema's arguments.
- ``fake``: the shapes-only kernel ``torch.compile`` runs on fake tensors: called with the
  schema's arguments, it returns new empty outputs of the right shapes and dtypes
  (``t.new_empty(...)``) and reads no value; ``None`` for an op without outputs.
- ``mutates_args``: every parameter the op writes in place. Tracing relies on it: a write to
  an undeclared argument can be dropped or reordered. Outputs must be fresh tensors (never an
  input or a view of one).
- ``schema``: the schema text, when it must be exactly someone else's (argument names,
  order, defaults, ``Tensor!`` / ``Tensor(a!)?`` writes), e.g.
  ``"gather(Tensor src, Tensor! dst, int n=0) -> ()"`` (the leading name may be left out).
  Its written arguments are the mutated ones (``mutates_args``, if given, must name the same).
- ``backend_arg``: how the CPU and CUDA kernels are chosen. ``None``: the CPU kernel is
  ``reference`` and the CUDA kernel ``triton`` (a caller that wants another backend calls it
  directly). A parameter name (a positional ``Tensor``): both dispatch keys run a selector
  that, at every call, reads ``$HISPARSE_TRITON_BACKEND`` (``ops.backends.select_backend``
  on that argument's device) and runs ``reference`` (``torch``) or ``triton``.

Contract of ``register_family(family, definitions, namespace=..., on_existing=...)``:

- Everything is checked before ``torch.library`` is touched: the family, namespace and op
  names are identifiers; no op name is given twice; the schema parses (or infers: every
  reference parameter and its return annotated) and names the op; every ``mutates_args``
  entry is a written argument; ``reference`` and ``triton`` take the schema's arguments (a
  kernel with named parameters names them in order; one taking ``*args`` takes anything);
  ``fake`` accepts them; ``backend_arg`` names a positional ``Tensor`` argument. A refused call
  raises ``ValueError`` (``TypeError`` for something that is not an ``OpDefinition`` or not
  callable) naming the bad value, and registers nothing.
- An op that already exists (anyone's: known to torch or in ``OP_TABLE``) is handled by
  ``on_existing``: ``"refuse"`` (the default: ``ValueError``, nothing registered);
  ``"keep"`` (left as it is: outcome ``"kept"``); ``"replace"`` (our CPU and CUDA kernels
  replace its own; its fake kernel is kept where it has one, ours added otherwise; its schema
  must have our arguments, types and writes, else ``ValueError``: outcome ``"replaced"``).
  Under ``"keep"`` and ``"replace"`` an op this helper already registered from the same
  definition is left as it is: outcome ``"unchanged"``. A new op's outcome is ``"defined"``.
- On success the call returns a ``Registration``: ``{name: torch.ops.<namespace>.<name>}`` in
  the order given, plus ``outcomes``. Every op that now runs our kernels (``"defined"``,
  ``"replaced"``) is recorded in ``OP_TABLE`` as ``"<namespace>::<name>" -> RegisteredOp``.
  If torch itself raises half-way, every registration the call made is undone and the
  table is left as it was.
- The same definitions may be registered under several namespaces: each registration is its
  own op with its own table entry. A registration lasts for the process (this module keeps
  its ``Library`` objects alive), so register at import time, once.
- It only registers. Whether a call goes through ``torch.ops`` is the caller's choice (the
  public functions of ``hisparse_triton.ops`` skip the dispatcher for eager calls).
"""

from __future__ import annotations

import inspect
import warnings
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable, Iterator, Mapping, Optional, Sequence

import torch

from hisparse_triton.ops.backends import select_backend

__all__ = ["NAMESPACE", "ON_EXISTING", "OP_TABLE", "OpDefinition", "RegisteredOp",
           "Registration", "register_family"]

#: The namespace of this package's ops: ``torch.ops.hisparse_triton.<name>``.
NAMESPACE = "hisparse_triton"
#: What ``register_family`` may do with an op that already exists.
ON_EXISTING = ("refuse", "keep", "replace")


@dataclass(frozen=True)
class OpDefinition:
    """One op: what ``register_family`` registers (see the module docstring)."""

    name: str
    reference: Callable[..., Any]
    triton: Callable[..., Any]
    fake: Callable[..., Any]
    mutates_args: tuple[str, ...] = ()
    schema: Optional[str] = None
    backend_arg: Optional[str] = None


@dataclass(frozen=True)
class RegisteredOp:
    """An entry of ``OP_TABLE``: an op that runs our kernels, its family and definition."""

    namespace: str
    family: str
    definition: OpDefinition
    op: Any  # torch._ops.OpOverloadPacket: call it like the reference
    outcome: str = "defined"  # or "replaced": the op existed and ours replaced its kernels

    @property
    def qualname(self) -> str:
        """``"<namespace>::<name>"``, the key of this entry."""
        return f"{self.namespace}::{self.definition.name}"

    @property
    def schema(self) -> str:
        """The op's schema as torch has it."""
        return str(self.op.default._schema)


class Registration(Mapping[str, Any]):
    """What one ``register_family`` call left: ``{name: op}`` in the order given (the op is
    ``torch.ops.<namespace>.<name>``), and ``outcomes[name]``: ``"defined"``, ``"replaced"``,
    ``"kept"`` or ``"unchanged"``."""

    def __init__(self, ops: dict[str, Any], outcomes: dict[str, str]) -> None:
        self._ops = ops
        self.outcomes: Mapping[str, str] = MappingProxyType(outcomes)

    def __getitem__(self, name: str) -> Any:
        return self._ops[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._ops)

    def __len__(self) -> int:
        return len(self._ops)

    @property
    def changed(self) -> bool:
        """Whether the call registered anything (an op ``"defined"`` or ``"replaced"``)."""
        return any(o in ("defined", "replaced") for o in self.outcomes.values())

    def __repr__(self) -> str:
        return f"Registration({dict(self.outcomes)!r})"


_TABLE: dict[str, RegisteredOp] = {}
#: Every op whose kernels ``register_family`` registered: ``"<namespace>::<name>" ->
#: RegisteredOp`` (read-only).
OP_TABLE: Mapping[str, RegisteredOp] = MappingProxyType(_TABLE)
#: The ``torch.library.Library`` objects: a registration lives as long as its library.
_LIBRARIES: list[torch.library.Library] = []
#: torch's warning when a kernel replaces another one for the same dispatch key.
_OVERRIDE_WARNING = r"(?s).*Overriding a previously registered kernel"


@dataclass(frozen=True)
class _Plan:
    """What ``register_family`` does for one definition, decided before anything changes."""

    definition: OpDefinition
    qualname: str
    schema: Any  # torch._C.FunctionSchema
    schema_text: str  # what Library.define takes: "<name>(<arguments>) -> <returns>"
    outcome: str  # "defined", "replaced", "kept", "unchanged"
    add_fake: bool


def register_family(family: str, definitions: Sequence[OpDefinition], *,
                    namespace: str = NAMESPACE, on_existing: str = "refuse") -> Registration:
    """Register the ops of ``family`` as ``torch.ops.<namespace>.<name>`` (kernels per dispatch
    key, fake kernel, declared mutations) and record them in ``OP_TABLE``.

    ``on_existing`` (``"refuse"`` / ``"keep"`` / ``"replace"``) says what happens to an op
    that already exists. Returns the ``Registration`` (ops by name, outcomes). Checks
    everything first and raises ``ValueError`` / ``TypeError`` naming the bad value without
    registering anything (the full contract is in the module docstring).
    """
    _check_identifier("family", family)
    _check_identifier("namespace", namespace)
    if on_existing not in ON_EXISTING:
        raise ValueError(f"register_family: on_existing must be one of {', '.join(ON_EXISTING)}"
                         f", got {on_existing!r}")
    definitions = tuple(definitions)
    if not definitions:
        raise ValueError(f"register_family: family {family!r} has no op definitions")
    plans: list[_Plan] = []
    for definition in definitions:
        plan = _plan(definition, namespace, on_existing)
        if any(p.definition.name == definition.name for p in plans):
            raise ValueError(f"register_family: op {definition.name!r} is given twice in "
                             f"family {family!r}")
        plans.append(plan)

    libraries = _apply(namespace, plans)
    _LIBRARIES.extend(libraries)
    namespace_ops = getattr(torch.ops, namespace)
    ops = {plan.definition.name: getattr(namespace_ops, plan.definition.name)
           for plan in plans}
    for plan in plans:  # recorded only once every op is registered
        if plan.outcome in ("defined", "replaced"):
            _TABLE[plan.qualname] = RegisteredOp(namespace, family, plan.definition,
                                                 ops[plan.definition.name], plan.outcome)
    return Registration(ops, {plan.definition.name: plan.outcome for plan in plans})


def _apply(namespace: str, plans: list[_Plan]) -> list[torch.library.Library]:
    """Make the registrations of ``plans``; if torch raises, undo them all and re-raise."""
    libraries: dict[str, torch.library.Library] = {}
    try:
        for plan in plans:
            if plan.outcome not in ("defined", "replaced"):
                continue
            kind = "FRAGMENT" if plan.outcome == "defined" else "IMPL"
            if kind not in libraries:
                libraries[kind] = torch.library.Library(namespace, kind)
            lib = libraries[kind]
            definition = plan.definition
            if kind == "FRAGMENT":
                lib.define(plan.schema_text)
            cpu, cuda = _kernels(definition, plan.schema)
            with warnings.catch_warnings():  # replacing is what was asked: no torch warning
                warnings.filterwarnings("ignore", _OVERRIDE_WARNING, UserWarning)
                lib.impl(definition.name, cpu, "CPU")
                lib.impl(definition.name, cuda, "CUDA")
            if plan.add_fake:
                torch.library.register_fake(plan.qualname, definition.fake, lib=lib)
    except BaseException:
        for lib in libraries.values():
            lib._destroy()
        raise
    return list(libraries.values())


def _kernels(definition: OpDefinition, schema: Any) -> tuple[Callable[..., Any], ...]:
    """The (CPU, CUDA) kernels of ``definition``."""
    if definition.backend_arg is None:
        return definition.reference, definition.triton
    index = [a.name for a in schema.arguments].index(definition.backend_arg)
    run = _per_call_backend(definition.reference, definition.triton, index)
    run.__name__ = f"{definition.name}_per_call_backend"
    return run, run


def _per_call_backend(reference: Callable[..., Any], triton: Callable[..., Any],
                      index: int) -> Callable[..., Any]:
    """A kernel that runs ``reference`` or ``triton`` as ``$HISPARSE_TRITON_BACKEND`` says
    for the device of positional argument ``index``, read at every call."""
    def run(*args: Any, **kwargs: Any) -> Any:
        if select_backend(None, args[index].device) == "torch":
            return reference(*args, **kwargs)
        return triton(*args, **kwargs)

    return run


# ------------------------------------------------------------------------------ checks


def _check_identifier(what: str, value: object) -> None:
    if not isinstance(value, str) or not value.isidentifier():
        raise ValueError(f"register_family: {what} must be a Python identifier, got {value!r}")


def _plan(definition: OpDefinition, namespace: str, on_existing: str) -> _Plan:
    """Every rule of the module docstring for one definition; raises naming the bad value."""
    if not isinstance(definition, OpDefinition):
        raise TypeError(f"register_family: expected OpDefinition, got "
                        f"{type(definition).__name__}")
    name = definition.name
    _check_identifier("op name", name)
    qualname = f"{namespace}::{name}"
    for role in ("reference", "triton", "fake"):
        if not callable(getattr(definition, role)):
            raise TypeError(f"register_family: {qualname}: {role} must be callable, got "
                            f"{type(getattr(definition, role)).__name__}")
    mutates = definition.mutates_args
    if isinstance(mutates, str) or not all(isinstance(m, str) for m in mutates):
        raise ValueError(f"register_family: {qualname}: mutates_args must be a tuple of "
                         f"parameter names, got {mutates!r}")
    schema, text = _schema(definition, namespace)
    _check_kernels(definition, schema, qualname)
    _check_backend_arg(definition, schema, qualname)

    entry = _TABLE.get(qualname)
    exists = entry is not None or _known_to_torch(qualname)
    if not exists:
        return _Plan(definition, qualname, schema, text, "defined", True)
    if on_existing == "refuse":
        if entry is not None:
            raise ValueError(f"register_family: {qualname} is already registered (family "
                             f"{entry.family!r})")
        raise ValueError(f"register_family: torch already has an op {qualname}")
    if entry is not None and entry.definition == definition:
        return _Plan(definition, qualname, schema, text, "unchanged", False)
    if on_existing == "keep":
        return _Plan(definition, qualname, schema, text, "kept", False)
    _check_same_signature(qualname, schema)
    return _Plan(definition, qualname, schema, text, "replaced", not _has_fake(qualname))


def _schema(definition: OpDefinition, namespace: str) -> tuple[Any, str]:
    """The schema of ``definition`` (given, or inferred from the reference): parsed, and as
    text without the namespace."""
    name, qualname = definition.name, f"{namespace}::{definition.name}"
    params = list(inspect.signature(definition.reference).parameters)
    mutates = definition.mutates_args
    if definition.schema is None:
        reference = inspect.signature(definition.reference)
        unannotated = [p for p, v in reference.parameters.items() if v.annotation is v.empty]
        if unannotated or reference.return_annotation is reference.empty:
            what = f"parameters {unannotated}" if unannotated else "the return"
            raise ValueError(f"register_family: {qualname}: the reference must annotate every "
                             f"parameter and its return (they are the schema); {what} has "
                             f"none")
        unknown = [m for m in mutates if m not in params]
        if unknown:
            raise ValueError(f"register_family: {qualname}: mutates_args names {unknown}, "
                             f"which are not parameters of the reference {params}")
        try:
            text = torch.library.infer_schema(definition.reference, mutates_args=mutates,
                                              op_name=name)
        except (ValueError, TypeError) as exc:
            raise ValueError(f"register_family: {qualname}: no schema from the reference: "
                             f"{exc}") from exc
        return torch._C.parse_schema(f"{namespace}::{text}"), text

    text = definition.schema
    if not isinstance(text, str):
        raise ValueError(f"register_family: {qualname}: schema must be a string, got "
                         f"{type(text).__name__}")
    text = text.strip()
    if text.startswith("("):
        text = name + text
    try:
        schema = torch._C.parse_schema(f"{namespace}::{text}")
    except RuntimeError as exc:
        raise ValueError(f"register_family: {qualname}: the schema {definition.schema!r} "
                         f"does not parse: {exc}") from None
    if schema.name != qualname or schema.overload_name:
        given = schema.name.split("::")[-1] + (f".{schema.overload_name}"
                                                if schema.overload_name else "")
        raise ValueError(f"register_family: {qualname}: the schema names the op {given!r}, "
                         f"not {name!r}")
    written = [a.name for a in schema.arguments if _is_write(a)]
    if mutates and sorted(mutates) != sorted(written):
        raise ValueError(f"register_family: {qualname}: mutates_args names {list(mutates)}, "
                         f"the schema writes {written}; they must match")
    return schema, text


def _check_kernels(definition: OpDefinition, schema: Any, qualname: str) -> None:
    """``reference`` and ``triton`` take the schema's arguments (by name, in order, unless
    they take ``*args``); ``fake`` accepts them."""
    positional = [a.name for a in schema.arguments if not a.kwarg_only]
    keywords = {a.name: a.name for a in schema.arguments if a.kwarg_only}
    names = [a.name for a in schema.arguments]
    for role in ("reference", "triton"):
        signature = inspect.signature(getattr(definition, role))
        kinds = {p.kind for p in signature.parameters.values()}
        takes_any = inspect.Parameter.VAR_POSITIONAL in kinds
        params = [p for p, v in signature.parameters.items()
                  if v.kind not in (v.VAR_POSITIONAL, v.VAR_KEYWORD)]
        if (not takes_any and params != names) or not _binds(signature, positional, keywords):
            what = "the reference" if definition.schema is None else "the schema"
            raise ValueError(f"register_family: {qualname}: the {role} kernel takes {params}, "
                             f"{what} passes {names}; they must match")
    if not _binds(inspect.signature(definition.fake), positional, keywords):
        raise ValueError(f"register_family: {qualname}: the fake kernel cannot take the "
                         f"{len(names)} arguments {names}")


def _binds(signature: inspect.Signature, positional: list[str], keywords: dict) -> bool:
    try:
        signature.bind(*positional, **keywords)
    except TypeError:
        return False
    return True


def _check_backend_arg(definition: OpDefinition, schema: Any, qualname: str) -> None:
    arg = definition.backend_arg
    if arg is None:
        return
    tensors = [a.name for a in schema.arguments
               if not a.kwarg_only and str(a.type) == "Tensor"]
    if arg not in tensors:
        raise ValueError(f"register_family: {qualname}: backend_arg {arg!r} must name a "
                         f"positional Tensor argument, one of {tensors}")


def _is_write(argument: Any) -> bool:
    return argument.alias_info is not None and argument.alias_info.is_write


def _signature_of(schema: Any) -> tuple:
    """What a kernel relies on: argument names, types, writes, keyword-only; return types."""
    return (tuple((a.name, str(a.type), _is_write(a), a.kwarg_only) for a in schema.arguments),
            tuple(str(r.type) for r in schema.returns))


def _check_same_signature(qualname: str, schema: Any) -> None:
    """An op we replace must take what our kernels take."""
    existing = torch._C._dispatch_find_schema_or_throw(qualname, "").schema()
    if _signature_of(existing) != _signature_of(schema):
        raise ValueError(f"register_family: cannot replace {qualname}: its schema "
                         f"{existing} differs from ours {schema}")


def _known_to_torch(qualname: str) -> bool:
    """Whether the dispatcher knows ``qualname`` (from anyone)."""
    try:
        torch._C._dispatch_find_schema_or_throw(qualname, "")
    except RuntimeError:
        return False
    return True


def _has_fake(qualname: str) -> bool:
    """Whether ``qualname`` already has a fake kernel (a Python one or a Meta kernel)."""
    entry = torch._library.simple_registry.singleton.find(qualname)
    return entry.fake_impl.kernel is not None or \
        torch._C._dispatch_has_kernel_for_dispatch_key(qualname, "Meta")

