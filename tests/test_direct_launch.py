"""Direct launches (``kernels.direct_launch``): the compiled launcher is called with exactly the
arguments Triton's normal launch path passes, and every reason not to call it falls back.

The direct path needs compiled kernels, so its checks run in a subprocess without
``TRITON_INTERPRET`` under the stand-in CUDA driver (``kernels.standin_driver``: real sm_90
compiles with Triton's ptxas, launches recorded instead of run). Under the interpreter a
``DirectLaunch`` always takes the normal path: checked here in-process, with real results.
"""

from __future__ import annotations

import os
import sys
import textwrap

import pytest
import torch

from hisparse_triton.kernels import gather
from hisparse_triton.kernels.direct_launch import DirectLaunch, direct_launch_enabled
from compiled_run import run_compiled
from test_copy_reference import make_table, random_plan, run_reference

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

#: Run in a fresh interpreter without TRITON_INTERPRET: copies through ``BoundCopy`` (direct
#: launches) and through ``launch_copy`` (Triton's normal path) must hand the launcher the
#: same grid and arguments; the fallbacks must take the normal path.
_STANDIN_CHECK = textwrap.dedent('''
    import json, sys, torch
    from triton import knobs
    from hisparse_triton.kernels import gather
    from hisparse_triton.kernels.direct_launch import DirectLaunch
    from hisparse_triton.kernels.standin_driver import standin_cuda_driver
    sys.path.insert(0, sys.argv[1])
    from test_copy_reference import make_table, random_plan

    src = make_table(3, 656, 6, layout="host", seed=1, device="cpu")
    dst = make_table(3, 656, 4, layout="device", seed=2, device="cpu")
    s, d, c = random_plan(3, 2, 5, src.num_rows, dst.num_rows, mode="per_layer", seed=3,
                          device="cpu")
    out = {}

    def value(x):  # what the launcher reads: a tensor's address, or the value itself
        return x.data_ptr() if isinstance(x, torch.Tensor) else x

    def same(a, b):
        return a.grid == b.grid and len(a.args) == len(b.args) and all(
            value(x) == value(y) for x, y in zip(a.args, b.args))

    def addresses_only(call):  # a direct launch hands the launcher no tensor at all
        return not any(isinstance(x, torch.Tensor) for x in call.args)

    with standin_cuda_driver() as launch:
        gather.launch_copy(dst, src, s, d, c, pages=False, kernel="gather")  # normal path
        normal = launch.calls[-1]
        bound = gather.BoundCopy(dst, src, pages=False, kernel="gather")
        for _ in range(3):
            bound(s, d, c)
        direct = bound._calls[(id(s), id(d), id(c))][6]
        out["bound_paths"] = [direct.fallback_calls, direct.direct_calls]
        out["bound_same_args"] = all(same(call, normal) for call in launch.calls[-3:])
        out["bound_addresses"] = [addresses_only(call) for call in launch.calls[-3:]]
        out["launcher"] = type(direct._launcher[0]).__name__ if direct.bound else None
        out["forwarded"] = direct.forwarded
        # the emulated address reads pick the pointer parameters by the kernel signature:
        # the normal launch's tensors, nothing else
        pickers = [p for _, p in launch._pickers.values()]
        out["picked"] = [[isinstance(x, torch.Tensor) for x in p(normal.args)]
                         for p in pickers if p is not None]
        out["tensor_args"] = sum(isinstance(a, torch.Tensor) for a in normal.args)

        # A DirectLaunch with a dynamic tensor: same arguments as the normal path, a new
        # address of the same alignment stays direct, a misaligned one falls back.
        args = list(normal.args)
        kernel = gather.copy_rows_kernel
        names = [p.name for p in kernel.params]
        positional = [a for a, p in zip(args, kernel.params) if not p.is_constexpr]
        constexprs = {p.name: a for a, p in zip(args, kernel.params) if p.is_constexpr}
        constexprs["num_warps"], constexprs["num_stages"] = 4, 2
        at = names.index("src_ids_ptr") if "src_ids_ptr" in names else 4
        one = DirectLaunch(kernel, normal.grid[:2], positional, constexprs, dynamic=(at,))
        moved = s.clone()
        one(s); one(moved)
        out["dynamic_paths"] = [one.fallback_calls, one.direct_calls]
        first, second = launch.calls[-2], launch.calls[-1]
        out["dynamic_same_args"] = (same(first, normal)
                                    and value(second.args[at]) == moved.data_ptr()
                                    and same(second._replace(args=second.args[:at]),
                                             first._replace(args=first.args[:at])))
        shifted = torch.zeros(s.numel() + 1, dtype=s.dtype)[1:].view(s.shape)
        one(shifted)
        out["misaligned_paths"] = [one.fallback_calls, one.direct_calls]
        # both alignment patterns are bound now: alternating stays direct
        one(s); one(shifted); one(s.clone())
        out["alternating_paths"] = [one.fallback_calls, one.direct_calls]
        out["alternating_args"] = value(launch.calls[-2].args[at]) == shifted.data_ptr()

        # BoundCopy.shaped: new plan tensors of one layout every call, bound once
        bound2 = gather.BoundCopy(dst, src, pages=False, kernel="gather")
        plans = [(s.clone(), d.clone(), c.clone()) for _ in range(3)]
        for plan in plans:
            bound2.shaped(*plan)
        shaped = next(iter(bound2._shaped.values()))
        out["shaped_paths"] = [shaped.fallback_calls, shaped.direct_calls]
        # each call reads its own plan's tensors, everything else as the normal path
        out["shaped_same_args"] = all(
            same(a, normal._replace(args=normal.args[:at] + plan + normal.args[at + 3:]))
            for a, plan in zip(launch.calls[-3:], plans))

        hook = lambda metadata: None
        knobs.runtime.launch_enter_hook.add(hook)
        try:
            bound(s, d, c)
        finally:
            knobs.runtime.launch_enter_hook.remove(hook)
        out["hooked_paths"] = [direct.fallback_calls, direct.direct_calls]
    print(json.dumps(out))
''')


def _run_standin_check(extra_env: dict[str, str] | None = None) -> dict:
    return run_compiled(_STANDIN_CHECK, extra_env=extra_env, timeout=600)


@pytest.mark.skipif(sys.platform != "linux", reason="the stand-in compiles with Triton's ptxas")
def test_direct_launches_pass_the_normal_paths_arguments():
    out = _run_standin_check()
    assert out["bound_paths"] == [1, 2]            # bound once by the normal path, then direct
    assert out["bound_same_args"]
    assert out["bound_addresses"] == [False, True, True]  # the normal path passes tensors
    # Triton's own launcher class (the pinned 3.7's), its Python __call__ skipped
    assert out["launcher"] == "CudaLauncher" and out["forwarded"]
    # one launcher (the copy kernel's): its pointer parameters are the tensors it was given
    assert out["picked"] == [[True] * out["tensor_args"]] and out["tensor_args"] >= 4
    assert out["dynamic_paths"] == [1, 1]
    assert out["dynamic_same_args"]
    assert out["misaligned_paths"] == [2, 1]       # an alignment change takes the normal path
    assert out["hooked_paths"] == [2, 2]           # a launch hook takes the normal path
    assert out["alternating_paths"] == [2, 4]      # each alignment pattern bound once
    assert out["alternating_args"]
    assert out["shaped_paths"] == [1, 2]           # new tensors, one layout: bound once
    assert out["shaped_same_args"]


@pytest.mark.skipif(sys.platform != "linux", reason="the stand-in compiles with Triton's ptxas")
def test_direct_launches_can_be_turned_off():
    out = _run_standin_check({"HISPARSE_TRITON_DIRECT_LAUNCH": "0"})
    assert out["bound_paths"] == [3, 0]
    assert out["dynamic_paths"] == [2, 0]
    assert out["shaped_paths"] == [3, 0]


@pytest.mark.skipif(not INTERPRET, reason="checks the interpreter's path")
def test_interpreted_launches_take_the_normal_path_and_copy_exactly():
    assert not direct_launch_enabled()
    src = make_table(2, 132, 5, layout="host", seed=4, device="cpu")
    dst = make_table(2, 132, 4, layout="device", seed=5, device="cpu")
    s, d, c = random_plan(2, 3, 4, src.num_rows, dst.num_rows, mode="per_layer", seed=6,
                          device="cpu")
    expected = run_reference(dst, src, s, d, c, pages=False)
    bound = gather.BoundCopy(dst, src, pages=False, kernel="gather")
    bound(s, d, c)
    assert torch.equal(dst.pool, expected)
    direct = bound._calls[(id(s), id(d), id(c))][6]
    assert direct.direct_calls == 0 and direct.fallback_calls == 1


def test_direct_launch_rejects_bad_arguments():
    with pytest.raises(ValueError, match="grid"):
        DirectLaunch(gather.copy_rows_kernel, (), (), {})
    with pytest.raises(ValueError, match="dynamic argument 0"):
        DirectLaunch(gather.copy_rows_kernel, (1,), (3,), {}, dynamic=(0,))


@pytest.mark.skipif(sys.platform != "linux", reason="the stand-in compiles with Triton's ptxas")
def test_launch_path_host_cost_runs_the_real_launch_path():
    """``bench --host``'s launch-path figures: a small step through Triton's real launch path
    (stand-in driver, fresh process), with direct launches off and on; same launches."""
    from hisparse_triton.benchmarks.step_cost import launch_path_host_cost

    small = dict(top_k=64, device_buffer_size=128, prompt_len=64, layers=2)
    before = launch_path_host_cost(4, 2, direct=False, **small)
    after = launch_path_host_cost(4, 2, direct=True, **small)
    bare = launch_path_host_cost(4, 2, direct=True, read_addresses=False, **small)
    assert "off" in before["launch_path"] and "on" in after["launch_path"]
    assert "left out" in bare["launch_path"] and "left out" not in after["launch_path"]
    assert before["step_launches"] == after["step_launches"] == bare["step_launches"] == 2 * 2 + 1
    assert after["resolve_rows_launches"] == 2
    assert after["step_ms"] > 0 and before["step_ms"] > 0


def test_the_standin_reads_tensor_addresses_unless_told_not_to():
    from hisparse_triton.kernels.standin_driver import StandInLaunch

    reads = []

    class Counting(torch.Tensor):
        def data_ptr(self):
            reads.append(1)
            return super().data_ptr()

    args = (torch.zeros(2), torch.zeros(2).as_subclass(Counting), 7, None, 123456789)
    StandInLaunch(record=False)((1, 1, 1), args)
    assert reads == [1]                   # the subclass's address was read (and the tensor's)
    StandInLaunch(record=False, read_addresses=False)((1, 1, 1), args)
    assert reads == [1]


def test_the_standin_picks_pointer_parameters_by_the_kernel_signature():
    from hisparse_triton.kernels.standin_driver import _KernelArg, _pointer_picker

    const, kern = _KernelArg(None, 0), _KernelArg(None, 1)
    args = ("a", 1, "b", "c", 64)
    pick = _pointer_picker([kern, kern, kern, kern, const], ("*i32", "i32", "*fp32", "*u8"))
    assert pick(args) == ("a", "b", "c")
    assert _pointer_picker([kern, const, kern], ("i64", "*i8"))(args) == ("b",)
    assert _pointer_picker([const, kern], ("i32",))(args) == ()
    # what it cannot read safely: every argument is checked (None)
    assert _pointer_picker([kern, _KernelArg((kern,), 2)], ("*i32", "*i32")) is None
    assert _pointer_picker([kern, kern], ("*i32",)) is None
    assert _pointer_picker(None, None) is None


@pytest.mark.parametrize("picked", [False, True])
@pytest.mark.parametrize("where", [0, 1, 40, 79])
def test_the_standin_reads_each_tensor_every_launch_and_no_scalar(where, picked):
    from hisparse_triton.kernels.standin_driver import StandInLaunch, _KernelArg

    reads = []

    class Counting(torch.Tensor):
        def data_ptr(self):
            reads.append(where)
            return super().data_ptr()

    class NotATensor:
        def data_ptr(self):  # not a tensor: the stand-in leaves it
            raise AssertionError("read an object that is not a tensor")

    scalars = [7, 2**40, True, None, 1.5, "s", NotATensor()] * 12
    args = tuple(scalars[:where]) + (torch.zeros(3).as_subclass(Counting),) + tuple(
        scalars[where:79])

    def signature(pointers: int) -> tuple:  # the first `pointers` arguments are pointers
        return ([_KernelArg(None, 1)] * len(args),
                tuple(["*i32"] * pointers + ["i64"] * (len(args) - pointers)))

    launch = StandInLaunch(record=False)
    how = signature(where + 1) if picked else ()
    launch((1, 1, 1), args, *how)
    launch((1, 1, 1), args, *how)          # the same tuple: its tensor is read again
    assert reads == [where, where]
    plain = tuple(scalars[:6])
    launch((1, 1, 1), plain, *how)        # nothing to read; remembered, not checked again
    assert launch._scalars[id(plain)] is plain and len(launch._scalars) == 1
    checks = []
    launch._read = lambda *a: checks.append(a)
    launch((1, 1, 1), plain, *how)
    assert checks == [] and reads == [where, where]
    del launch._read
    if picked:   # a tensor outside the pointer parameters is not read (the C launcher's way)
        launch((1, 1, 1), args, *signature(where))
        assert reads == [where, where]
    StandInLaunch(record=False, read_addresses=False)((1, 1, 1), args, *how)
    assert reads == [where, where] and launch.count == 4 + picked


class _ForwardingLauncher:
    """Shaped like Triton 3.7's ``CudaLauncher``: ``__call__`` forwards to ``self.launch``
    with the kernel arguments as one tuple."""

    global_scratch_size = profile_scratch_size = 0

    def __init__(self, sink: list) -> None:
        self.launch = lambda *call: sink.append(call)

    def __call__(self, gx, gy, gz, stream, function, metadata, launch_metadata, enter, exit_,
                 *args):
        self.launch(gx, gy, gz, stream, function, False, False, metadata, launch_metadata,
                    enter, exit_, None, None, "annotations", "signature", args)


class _SpreadingLauncher(_ForwardingLauncher):
    """Forwards the kernel arguments one by one (not as one tuple): not forwardable."""

    def __call__(self, gx, gy, gz, stream, function, metadata, launch_metadata, enter, exit_,
                 *args):
        self.launch(gx, gy, gz, stream, function, *args)


class _ScratchLauncher(_ForwardingLauncher):
    global_scratch_size = 128   # allocates per launch: not forwardable


class _RaisingLauncher(_ForwardingLauncher):
    def __call__(self, *call):
        raise TypeError("not a stream")


def test_forwarding_replays_what_the_launchers_call_does():
    from hisparse_triton.kernels.direct_launch import _forwarding

    values = [1234567, 3, 4096, 16]
    launched: list = []
    launcher = _ForwardingLauncher(launched)
    own = launcher.launch
    forward = _forwarding(launcher, (4, 1, 1), "function", "metadata", values)
    assert forward is not None and not launched          # the watched call launched nothing
    assert launcher.launch is own and forward[0] is own  # a copy was watched, not the launcher
    launcher(4, 1, 1, 77, "function", "metadata", None, None, None, *values)  # its own path
    run, head, tail = forward
    run(*head, 77, *tail, tuple(values))                   # the forwarded path
    assert len(launched) == 2 and launched[0] == launched[1]
    assert launched[1][3] == 77 and launched[1][-1] == tuple(values)


@pytest.mark.parametrize("launcher_cls", [_SpreadingLauncher, _ScratchLauncher,
                                          _RaisingLauncher])
def test_forwarding_refuses_launchers_it_cannot_replay(launcher_cls):
    from hisparse_triton.kernels.direct_launch import _forwarding

    sink: list = []
    launcher = launcher_cls(sink)
    kept = launcher.launch
    assert _forwarding(launcher, (4, 1, 1), "function", "metadata", [1, 2, 3]) is None
    assert launcher.launch is kept and not sink           # left as it was, nothing launched
