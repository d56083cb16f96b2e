"""``ops.registry.register_family``: a toy op family registered in test namespaces, called
eagerly, traced (make_fx, torch.compile), through its fake kernel, with its mutation declared;
every refused registration leaves torch and the op table as they were."""

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
