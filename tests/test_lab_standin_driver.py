"""The stand-in CUDA driver (``lab.standin_driver``): Triton's real Python launch path with
real sm_90 compiles and the C launch replaced by a recorder, and what it reads of each launch's
arguments (the C launcher's address reads, emulated)."""

from __future__ import annotations

import sys

import pytest
import torch


@pytest.mark.skipif(sys.platform != "linux", reason="the stand-in compiles with Triton's ptxas")
def test_launch_path_host_cost_runs_the_real_launch_path():
    """``bench/host_cost.py``'s launch-path figures: a small step through Triton's real launch path
    (stand-in driver, fresh process), with and without the emulated address reads; same
    launches."""
    from lab.step_cost import launch_path_host_cost

    small = dict(top_k=64, device_buffer_size=128, prompt_len=64, layers=2)
    full = launch_path_host_cost(4, 2, **small)
    bare = launch_path_host_cost(4, 2, read_addresses=False, **small)
    assert "left out" in bare["launch_path"] and "left out" not in full["launch_path"]
    # per index group: the hash resolve, its fallback launch, the gather; then the mirror
    assert full["step_launches"] == bare["step_launches"] == 2 * 3 + 1
    assert full["resolve_rows_launches"] == 3
    assert full["step_ms"] > 0 and bare["step_ms"] > 0


def test_the_standin_reads_tensor_addresses_unless_told_not_to():
    from lab.standin_driver import StandInLaunch

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
    from lab.standin_driver import _KernelArg, _pointer_picker

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
    from lab.standin_driver import StandInLaunch, _KernelArg

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
