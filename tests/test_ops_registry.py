"""``ops.registry.register_family``: a toy op family registered in test namespaces, called
eagerly, traced (make_fx, torch.compile), through its fake kernel, with its mutation declared;
a given schema registered verbatim; each ``on_existing`` policy (refuse / keep / replace) on
someone else's op and on our own; the backend chosen per call from the environment; every
refused registration, and one where torch raises half-way, leaves torch and the op table as
they were."""

from __future__ import annotations

import itertools
from typing import Optional

import pytest
import torch
from torch import Tensor
from torch.fx.experimental.proxy_tensor import make_fx

from hisparse_triton import ops
from hisparse_triton.ops.registry import OP_TABLE, OpDefinition, register_family

HAS_CUDA = torch.cuda.is_available()
_NAMESPACES = itertools.count()
#: Calls of the toy "Triton" kernels (stand-ins that record themselves).
TRITON_CALLS: list[str] = []


def fresh_namespace() -> str:
    """Registrations last for the process: every test registers in a namespace of its own."""
    return f"hisparse_registry_test_{next(_NAMESPACES)}"


# ------------------------------------------------------------------------ the toy family


def scale_into_reference(dst: Tensor, src: Tensor, factor: int, bias: Optional[Tensor]) -> None:
    """``dst = src * factor (+ bias)``, in place."""
    dst.copy_(src * factor if bias is None else src * factor + bias)


def scale_into_triton(dst, src, factor, bias):
    TRITON_CALLS.append("scale_into")
    scale_into_reference(dst, src, factor, bias)


def scale_into_fake(dst, src, factor, bias) -> None:
    return None


def row_stats_reference(x: Tensor, offset: int) -> tuple[Tensor, Tensor]:
    """``(x.sum(1) + offset, x.amax(1))``: ``[R]`` each, ``x``'s dtype."""
    return x.sum(1) + offset, x.amax(1)


def row_stats_triton(x, offset):
    TRITON_CALLS.append("row_stats")
    return row_stats_reference(x, offset)


def row_stats_fake(x, offset):
    return x.new_empty(x.shape[0]), x.new_empty(x.shape[0])


SCALE_INTO = OpDefinition("scale_into", scale_into_reference, scale_into_triton,
                          scale_into_fake, mutates_args=("dst",))
ROW_STATS = OpDefinition("row_stats", row_stats_reference, row_stats_triton, row_stats_fake)


def register_toy(namespace: str) -> dict:
    return register_family("toy", (SCALE_INTO, ROW_STATS), namespace=namespace)


@pytest.fixture
def toy():
    """``(namespace, {name: op})`` of a freshly registered toy family."""
    TRITON_CALLS.clear()
    namespace = fresh_namespace()
    return namespace, register_toy(namespace)


def known_to_torch(namespace: str, name: str) -> bool:
    return hasattr(getattr(torch.ops, namespace), name)


def step(dst: Tensor, src: Tensor, x: Tensor, namespace: str) -> tuple[Tensor, Tensor]:
    """A toy step: one in-place op, one op with outputs."""
    toy_ops = getattr(torch.ops, namespace)
    toy_ops.scale_into(dst, src, 3, None)
    total, peak = toy_ops.row_stats(x, 2)
    return dst * 1, total + peak


# ----------------------------------------------------------------------------- behaviour


def test_eager_calls_run_the_reference_on_cpu(toy):
    namespace, registered = toy
    src, bias, dst = torch.arange(6.0), torch.ones(6), torch.zeros(6)
    getattr(torch.ops, namespace).scale_into(dst, src, 2, bias)
    assert torch.equal(dst, src * 2 + 1)
    registered["scale_into"](dst, src, 3, None)  # the returned op is the same op
    assert torch.equal(dst, src * 3)
    x = torch.tensor([[1.0, 5.0], [4.0, 2.0]])
    total, peak = registered["row_stats"](x, 10)
    assert torch.equal(total, torch.tensor([16.0, 16.0]))
    assert torch.equal(peak, torch.tensor([5.0, 4.0]))
    assert TRITON_CALLS == []  # CPU tensors never reach the CUDA kernel


def test_the_op_table_records_each_op_and_its_family(toy):
    namespace, registered = toy
    for name in ("scale_into", "row_stats"):
        entry = OP_TABLE[f"{namespace}::{name}"]
        assert entry.family == "toy" and entry.namespace == namespace
        assert entry.qualname == f"{namespace}::{name}" and entry.op is registered[name]
    assert OP_TABLE[f"{namespace}::scale_into"].definition is SCALE_INTO
    assert list(registered) == ["scale_into", "row_stats"]
    with pytest.raises(TypeError):
        OP_TABLE["x::y"] = OP_TABLE[f"{namespace}::row_stats"]  # read-only


def test_the_packages_families_are_in_the_table():
    families = {name: entry.family for name, entry in ops.OP_TABLE.items()
                if entry.namespace == "hisparse_triton"}
    assert families == {"hisparse_triton::copy_rows": "copy",
                        "hisparse_triton::copy_pages": "copy",
                        "hisparse_triton::plan_prefill": "prefill",
                        "hisparse_triton::resolve": "resolve"}
    assert ops.OP_TABLE["hisparse_triton::resolve"].op is ops.resolve_op
    assert ops.OP_TABLE["hisparse_triton::copy_rows"].op is ops.copy_rows_op
    assert ops.OP_TABLE["hisparse_triton::resolve"].definition.mutates_args == (
        "slot_host_rows", "lru")


def test_the_schema_declares_the_mutation(toy):
    namespace, _ = toy
    def written(op) -> list[str]:
        return [a.name for a in op.default._schema.arguments
                if a.alias_info is not None and a.alias_info.is_write]

    toy_ops = getattr(torch.ops, namespace)
    assert written(toy_ops.scale_into) == ["dst"]
    assert written(toy_ops.row_stats) == []
    assert len(toy_ops.row_stats.default._schema.returns) == 2


def test_opcheck_passes(toy):
    namespace, _ = toy
    toy_ops = getattr(torch.ops, namespace)
    torch.library.opcheck(toy_ops.scale_into.default,
                          (torch.zeros(4), torch.arange(4.0), 2, torch.ones(4)))
    torch.library.opcheck(toy_ops.row_stats.default, (torch.randn(3, 5), 1))


def test_the_fake_kernel_gives_the_output_shapes(toy):
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    namespace, _ = toy
    with FakeTensorMode() as mode:
        x = mode.from_tensor(torch.randn(5, 3))
        total, peak = getattr(torch.ops, namespace).row_stats(x, 1)
        dst = mode.from_tensor(torch.zeros(5))
        assert getattr(torch.ops, namespace).scale_into(dst, dst, 2, None) is None
    for out in (total, peak):
        assert isinstance(out, FakeTensor) and out.shape == (5,) and out.dtype == torch.float32
    assert TRITON_CALLS == []


def test_make_fx_traces_each_op_as_one_node(toy):
    namespace, _ = toy
    dst, src, x = torch.zeros(4), torch.arange(4.0), torch.randn(2, 3)
    graph = make_fx(lambda d, s, v: step(d, s, v, namespace), tracing_mode="fake")(dst, src, x)
    targets = [str(node.target) for node in graph.graph.nodes if node.op == "call_function"]
    assert targets.count(f"{namespace}.scale_into.default") == 1
    assert targets.count(f"{namespace}.row_stats.default") == 1
    assert torch.equal(dst, torch.zeros(4))  # tracing ran the fake kernels only


def test_torch_compile_keeps_the_declared_mutation(toy):
    namespace, _ = toy
    src, x = torch.arange(4.0), torch.randn(2, 3)
    want_dst = torch.zeros(4)
    want = step(want_dst, src, x, namespace)
    got_dst = torch.zeros(4)
    compiled = torch.compile(lambda d, s, v: step(d, s, v, namespace), backend="aot_eager",
                             fullgraph=True)
    got = compiled(got_dst, src, x)
    assert torch.equal(got_dst, want_dst) and torch.equal(got_dst, src * 3)
    for g, w in zip(got, want):
        assert torch.equal(g, w)


def test_one_family_registers_under_several_namespaces():
    first, second = fresh_namespace(), fresh_namespace()
    ops_a, ops_b = register_toy(first), register_toy(second)
    assert ops_a["scale_into"] is not ops_b["scale_into"]
    for namespace in (first, second):
        dst = torch.zeros(3)
        getattr(torch.ops, namespace).scale_into(dst, torch.ones(3), 4, None)
        assert torch.equal(dst, torch.full((3,), 4.0))
        assert OP_TABLE[f"{namespace}::scale_into"].definition is SCALE_INTO


@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_cuda_tensors_run_the_triton_kernel(toy):
    namespace, registered = toy
    dst, src = torch.zeros(4, device="cuda"), torch.arange(4.0, device="cuda")
    registered["scale_into"](dst, src, 2, None)
    registered["row_stats"](src.view(2, 2), 0)
    assert TRITON_CALLS == ["scale_into", "row_stats"]
    assert torch.equal(dst.cpu(), torch.arange(4.0) * 2)


# ------------------------------------------------------------------------------ refusals


def _unannotated(dst, src, factor, bias):
    return None


def _takes_a_dict(dst: Tensor, options: dict) -> None:
    return None


def _fake_dict(dst, options) -> None:
    return None


REFUSED = {
    "unknown mutated arg": (dict(mutates_args=("out",)), ValueError,
                            r"mutates_args names \['out'\]"),
    "mutates_args as a string": (dict(mutates_args="dst"), ValueError, "tuple of parameter"),
    "triton parameters differ": (dict(triton=lambda dst, src, factor: None), ValueError,
                                 "the triton kernel takes"),
    "fake cannot take the arguments": (dict(fake=lambda dst: None), ValueError,
                                       "the fake kernel cannot take"),
    "unannotated reference": (dict(reference=_unannotated), ValueError, "must annotate"),
    "no schema for a dict": (dict(reference=_takes_a_dict, triton=_fake_dict, fake=_fake_dict,
                                  mutates_args=("dst",)), ValueError, "no schema"),
    "triton not callable": (dict(triton=None), TypeError, "triton must be callable"),
    "bad op name": (dict(name="scale-into"), ValueError, "op name must be"),
}


def _toy_with(**changes) -> OpDefinition:
    fields = dict(name="scale_into", reference=scale_into_reference,
                  triton=scale_into_triton, fake=scale_into_fake, mutates_args=("dst",))
    fields.update(changes)
    return OpDefinition(**fields)


def _assert_nothing_registered(namespace: str, before: dict) -> None:
    assert dict(OP_TABLE) == before
    assert not known_to_torch(namespace, "row_stats")
    assert not known_to_torch(namespace, "scale_into")


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_bad_definition_registers_nothing(case):
    """The good op before the bad one is not registered either: checks come first."""
    changes, error, message = REFUSED[case]
    namespace = fresh_namespace()
    before = dict(OP_TABLE)
    with pytest.raises(error, match=message):
        register_family("toy", (ROW_STATS, _toy_with(**changes)), namespace=namespace)
    _assert_nothing_registered(namespace, before)


@pytest.mark.parametrize("family,namespace,definitions,message", [
    ("toy", "not-an-identifier", (ROW_STATS,), "namespace must be"),
    ("", None, (ROW_STATS,), "family must be"),
    ("toy", None, (), "has no op definitions"),
    ("toy", None, (ROW_STATS, ROW_STATS), "'row_stats' is given twice"),
])
def test_bad_family_arguments_are_refused(family, namespace, definitions, message):
    namespace = namespace or fresh_namespace()
    before = dict(OP_TABLE)
    with pytest.raises(ValueError, match=message):
        register_family(family, definitions, namespace=namespace)
    assert dict(OP_TABLE) == before


def test_something_else_than_a_definition_is_refused():
    namespace = fresh_namespace()
    before = dict(OP_TABLE)
    with pytest.raises(TypeError, match="expected OpDefinition, got tuple"):
        register_family("toy", (ROW_STATS, ("scale_into",)), namespace=namespace)
    _assert_nothing_registered(namespace, before)


def test_a_name_is_registered_once(toy):
    namespace, registered = toy
    before = dict(OP_TABLE)
    with pytest.raises(ValueError, match=f"{namespace}::scale_into is already registered "
                                         r"\(family 'toy'\)"):
        register_toy(namespace)
    assert dict(OP_TABLE) == before
    assert OP_TABLE[f"{namespace}::scale_into"].op is registered["scale_into"]


def test_an_op_torch_already_has_is_refused():
    namespace = fresh_namespace()
    torch.library.custom_op(f"{namespace}::row_stats", row_stats_reference, mutates_args=())
    before = dict(OP_TABLE)
    with pytest.raises(ValueError, match=f"torch already has an op {namespace}::row_stats"):
        register_family("toy", (SCALE_INTO, ROW_STATS), namespace=namespace)
    assert dict(OP_TABLE) == before and not known_to_torch(namespace, "scale_into")


# ------------------------------------------------------------------------- given schemas

#: A schema in someone else's form: the written argument second, defaults, an alias set.
GIVEN_SCHEMA = ("scale_into(Tensor src, Tensor! dst, int factor=2, Tensor(a!)? peak=None) "
                "-> ()")


def given_reference(src, dst, factor=2, peak=None):
    """``dst = src * factor``; ``peak[0] = dst.max()`` when given (unannotated: the schema
    is given)."""
    dst.copy_(src * factor)
    if peak is not None:
        peak.copy_(dst.max().reshape(1))


def given_triton(src, dst, factor=2, peak=None):
    TRITON_CALLS.append("given")
    given_reference(src, dst, factor, peak)


def given_fake(*args) -> None:
    return None


GIVEN = OpDefinition("scale_into", given_reference, given_triton, given_fake,
                     schema=GIVEN_SCHEMA)


@pytest.fixture
def calls() -> list[str]:
    TRITON_CALLS.clear()
    return TRITON_CALLS


def test_a_given_schema_is_registered_verbatim(calls):
    namespace = fresh_namespace()
    registered = register_family("given", (GIVEN,), namespace=namespace)
    op = getattr(torch.ops, namespace).scale_into
    want = torch._C.parse_schema(f"{namespace}::{GIVEN_SCHEMA}")
    assert str(op.default._schema) == str(want)
    assert registered["scale_into"] is op and registered.outcomes == {"scale_into": "defined"}
    entry = OP_TABLE[f"{namespace}::scale_into"]
    assert entry.schema == str(want) and entry.outcome == "defined"
    written = [a.name for a in op.default._schema.arguments
               if a.alias_info is not None and a.alias_info.is_write]
    assert written == ["dst", "peak"]
    src, dst, peak = torch.arange(4.0), torch.zeros(4), torch.zeros(1)
    op(src, dst)  # the schema's default factor
    assert torch.equal(dst, src * 2)
    op(src, dst, 3, peak)
    assert torch.equal(dst, src * 3) and float(peak) == 9.0
    assert calls == []


def test_a_given_schema_passes_opcheck_and_compiles():
    namespace = fresh_namespace()
    register_family("given", (GIVEN,), namespace=namespace)
    op = getattr(torch.ops, namespace).scale_into
    torch.library.opcheck(op.default, (torch.arange(4.0), torch.zeros(4), 5, torch.zeros(1)))

    def step(src, dst, peak):
        op(src, dst, 4, peak)
        return dst + 1

    src = torch.arange(5.0)
    want_dst, want_peak = torch.zeros(5), torch.zeros(1)
    want = step(src, want_dst, want_peak)
    dst, peak = torch.zeros(5), torch.zeros(1)
    got = torch.compile(step, backend="aot_eager", fullgraph=True)(src, dst, peak)
    assert torch.equal(got, want) and torch.equal(dst, want_dst) and torch.equal(peak, want_peak)


def test_a_schema_without_the_name_takes_the_definitions():
    namespace = fresh_namespace()
    nameless = GIVEN_SCHEMA[len("scale_into"):]
    register_family("given", (_given_with(schema=nameless),), namespace=namespace)
    assert "peak" in OP_TABLE[f"{namespace}::scale_into"].schema


def _given_with(**changes) -> OpDefinition:
    fields = dict(name="scale_into", reference=given_reference, triton=given_triton,
                  fake=given_fake, schema=GIVEN_SCHEMA)
    fields.update(changes)
    return OpDefinition(**fields)


def _reference_renamed(source, dst, factor=2, peak=None):
    return None


GIVEN_REFUSED = {
    "does not parse": (dict(schema="scale_into(Tensor! -> ()"), "does not parse"),
    "names another op": (dict(schema="other" + GIVEN_SCHEMA[len("scale_into"):]),
                         "the schema names the op 'other'"),
    "an overload name": (dict(schema="scale_into.out" + GIVEN_SCHEMA[len("scale_into"):]),
                         "the schema names the op 'scale_into.out'"),
    "not a string": (dict(schema=42), "schema must be a string"),
    "mutates_args disagrees": (dict(mutates_args=("dst",)),
                               r"mutates_args names \['dst'\], the schema writes "
                               r"\['dst', 'peak'\]"),
    "reference names differ": (dict(reference=_reference_renamed),
                               r"the reference kernel takes \['source'"),
    "fake takes too few": (dict(fake=lambda src, dst: None), "the fake kernel cannot take"),
    "backend_arg unknown": (dict(backend_arg="index"), "backend_arg 'index' must name"),
    "backend_arg an int": (dict(backend_arg="factor"), "backend_arg 'factor' must name"),
    "backend_arg optional": (dict(backend_arg="peak"),
                             r"one of \['src', 'dst'\]"),
}


@pytest.mark.parametrize("case", sorted(GIVEN_REFUSED))
def test_a_bad_given_schema_registers_nothing(case):
    changes, message = GIVEN_REFUSED[case]
    namespace = fresh_namespace()
    before = dict(OP_TABLE)
    with pytest.raises(ValueError, match=message):
        register_family("given", (ROW_STATS, _given_with(**changes)), namespace=namespace)
    _assert_nothing_registered(namespace, before)


# ----------------------------------------------------------------------- existing ops


def theirs(namespace: str, schema: str = GIVEN_SCHEMA, *, with_fake: bool = False):
    """Someone else's op ``<namespace>::scale_into``: its CPU kernel fills ``dst`` with 777.
    Returns its library (keep it alive)."""
    lib = torch.library.Library(namespace, "FRAGMENT")
    lib.define(schema)
    lib.impl("scale_into", _fill_777, "CPU")
    if with_fake:
        torch.library.register_fake(f"{namespace}::scale_into", lambda *args: None, lib=lib)
    return lib


def _fill_777(src, dst, *rest) -> None:
    dst.fill_(777)


def call_scale_into(namespace: str) -> float:
    dst = torch.zeros(3)
    getattr(torch.ops, namespace).scale_into(torch.ones(3), dst, 5)
    return float(dst[0])


def test_refuse_is_the_default_and_registers_nothing():
    namespace = fresh_namespace()
    lib = theirs(namespace)
    before = dict(OP_TABLE)
    with pytest.raises(ValueError, match=f"torch already has an op {namespace}::scale_into"):
        register_family("given", (ROW_STATS, GIVEN), namespace=namespace)
    assert dict(OP_TABLE) == before and not known_to_torch(namespace, "row_stats")
    assert call_scale_into(namespace) == 777.0
    del lib


def test_keep_leaves_their_op_and_defines_the_rest():
    namespace = fresh_namespace()
    lib = theirs(namespace)
    done = register_family("given", (GIVEN, ROW_STATS), namespace=namespace,
                           on_existing="keep")
    assert dict(done.outcomes) == {"scale_into": "kept", "row_stats": "defined"}
    assert done.changed and list(done) == ["scale_into", "row_stats"]
    assert done["scale_into"] is getattr(torch.ops, namespace).scale_into
    assert call_scale_into(namespace) == 777.0
    assert f"{namespace}::scale_into" not in OP_TABLE
    assert OP_TABLE[f"{namespace}::row_stats"].outcome == "defined"
    del lib


@pytest.mark.parametrize("with_fake", (False, True))
def test_replace_gives_their_op_our_kernels(with_fake):
    import warnings

    from torch._subclasses.fake_tensor import FakeTensorMode

    namespace = fresh_namespace()
    lib = theirs(namespace, with_fake=with_fake)
    had_fake = torch._library.simple_registry.singleton.find(
        f"{namespace}::scale_into").fake_impl.kernel
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # replacing is asked for: torch's warning is silenced
        done = register_family("given", (GIVEN,), namespace=namespace, on_existing="replace")
    assert dict(done.outcomes) == {"scale_into": "replaced"}
    assert call_scale_into(namespace) == 5.0
    entry = OP_TABLE[f"{namespace}::scale_into"]
    assert entry.outcome == "replaced" and entry.definition is GIVEN
    fake = torch._library.simple_registry.singleton.find(f"{namespace}::scale_into").fake_impl
    if with_fake:  # theirs is kept
        assert fake.kernel is had_fake
    else:
        assert fake.kernel is not None
    with FakeTensorMode() as mode:
        dst = mode.from_tensor(torch.zeros(3))
        getattr(torch.ops, namespace).scale_into(dst, dst, 5)
    del lib


def test_replace_refuses_an_op_with_another_schema():
    namespace = fresh_namespace()
    lib = theirs(namespace, "scale_into(Tensor src, Tensor! dst, float factor=2.0) -> ()")
    before = dict(OP_TABLE)
    with pytest.raises(ValueError, match=f"cannot replace {namespace}::scale_into: its "
                                         "schema .* differs from ours"):
        register_family("given", (ROW_STATS, GIVEN), namespace=namespace,
                        on_existing="replace")
    assert dict(OP_TABLE) == before and not known_to_torch(namespace, "row_stats")
    assert call_scale_into(namespace) == 777.0
    del lib


@pytest.mark.parametrize("on_existing", ("keep", "replace"))
def test_our_own_op_from_the_same_definition_is_left_unchanged(toy, on_existing):
    from hisparse_triton.ops import registry

    namespace, registered = toy
    libraries = len(registry._LIBRARIES)
    entry = OP_TABLE[f"{namespace}::scale_into"]
    done = register_toy_with(namespace, on_existing)
    assert dict(done.outcomes) == {"scale_into": "unchanged", "row_stats": "unchanged"}
    assert not done.changed and done["scale_into"] is registered["scale_into"]
    assert len(registry._LIBRARIES) == libraries
    assert OP_TABLE[f"{namespace}::scale_into"] is entry


def register_toy_with(namespace: str, on_existing: str):
    return register_family("toy", (SCALE_INTO, ROW_STATS), namespace=namespace,
                           on_existing=on_existing)


def test_replace_swaps_our_own_op_for_a_new_definition(toy):
    namespace, _ = toy
    doubled = OpDefinition("row_stats", _doubled_row_stats, row_stats_triton, row_stats_fake)
    done = register_family("toy2", (doubled,), namespace=namespace, on_existing="replace")
    assert dict(done.outcomes) == {"row_stats": "replaced"}
    total, _ = getattr(torch.ops, namespace).row_stats(torch.ones(1, 2), 1)
    assert float(total[0]) == 4.0
    assert OP_TABLE[f"{namespace}::row_stats"].family == "toy2"


def _doubled_row_stats(x: Tensor, offset: int) -> tuple[Tensor, Tensor]:
    return row_stats_reference(x, 2 * offset)


def test_an_unknown_policy_is_refused():
    namespace = fresh_namespace()
    with pytest.raises(ValueError, match="on_existing must be one of refuse, keep, replace, "
                                         "got 'overwrite'"):
        register_family("toy", (ROW_STATS,), namespace=namespace, on_existing="overwrite")
    assert not known_to_torch(namespace, "row_stats")


# ---------------------------------------------------------------- per-call backend choice


PER_CALL = _given_with(backend_arg="src")


@pytest.fixture
def per_call_op(monkeypatch):
    TRITON_CALLS.clear()
    namespace = fresh_namespace()
    register_family("given", (PER_CALL,), namespace=namespace)
    op = getattr(torch.ops, namespace).scale_into

    def run(backend: Optional[str]) -> Tensor:
        if backend is None:
            monkeypatch.delenv("HISPARSE_TRITON_BACKEND", raising=False)
        else:
            monkeypatch.setenv("HISPARSE_TRITON_BACKEND", backend)
        dst = torch.zeros(3)
        op(torch.arange(3.0), dst, 3)
        return dst

    return run


@pytest.mark.parametrize("backend,ran", [(None, []), ("auto", []), ("torch", []),
                                         ("triton", ["given"])])
def test_per_call_backend_follows_the_environment(per_call_op, monkeypatch, backend, ran):
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the Triton backend on CPU tensors
    assert torch.equal(per_call_op(backend), torch.arange(3.0) * 3)
    assert TRITON_CALLS == ran


def test_per_call_backend_is_read_at_every_call(per_call_op, monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    per_call_op("triton"), per_call_op("torch"), per_call_op("triton")
    assert TRITON_CALLS == ["given", "given"]


def test_per_call_backend_errors_name_the_value(per_call_op, monkeypatch):
    from hisparse_triton.ops.backends import BackendUnavailableError

    with pytest.raises(ValueError, match="'cuda-graphs' is not a backend"):
        per_call_op("cuda-graphs")
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(BackendUnavailableError, match="needs CUDA tensors"):
        per_call_op("triton")
    assert TRITON_CALLS == []


def test_without_backend_arg_cpu_tensors_run_the_reference(toy, monkeypatch):
    namespace, registered = toy
    monkeypatch.setenv("HISPARSE_TRITON_BACKEND", "triton")
    registered["scale_into"](torch.zeros(2), torch.ones(2), 2, None)
    assert TRITON_CALLS == []


# ------------------------------------------------------------------ torch raising half-way


def test_torch_raising_half_way_undoes_every_registration(monkeypatch):
    namespace = fresh_namespace()
    lib = theirs(namespace)
    real = torch.library.register_fake
    calls = []

    def fail_on_the_second(qualname, *args, **kwargs):
        calls.append(qualname)
        if len(calls) == 2:
            raise RuntimeError("injected")
        return real(qualname, *args, **kwargs)

    monkeypatch.setattr(torch.library, "register_fake", fail_on_the_second)
    before = dict(OP_TABLE)
    other = OpDefinition("other_stats", row_stats_reference, row_stats_triton, row_stats_fake)
    with pytest.raises(RuntimeError, match="injected"):
        register_family("given", (ROW_STATS, GIVEN, other), namespace=namespace,
                        on_existing="replace")
    assert calls == [f"{namespace}::row_stats", f"{namespace}::scale_into"]
    assert dict(OP_TABLE) == before
    assert not known_to_torch(namespace, "row_stats")
    assert not known_to_torch(namespace, "other_stats")
    assert call_scale_into(namespace) == 777.0  # their kernel serves it again
    monkeypatch.setattr(torch.library, "register_fake", real)
    done = register_family("given", (ROW_STATS, GIVEN), namespace=namespace,
                           on_existing="replace")
    assert dict(done.outcomes) == {"row_stats": "defined", "scale_into": "replaced"}
    assert call_scale_into(namespace) == 5.0
    del lib
