"""Pinning the host pool on CUDA and on ROCm builds of torch (``worker.host_register``),
tested on CPU: a fake ``torch.cuda.cudart()`` stands in for the runtime bindings, a stand-in
memory map and loader for the runtime library, and (where a C compiler exists) a real shared
library named like HIP's that exports ``hipGetLastError``."""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
import uuid

import pytest
import torch

from hisparse_triton.errors import HostMemoryError, ReadOnlyViewError
from hisparse_triton.worker import host_register
from hisparse_triton.worker.host_register import CUDA, HIP
from hisparse_triton.worker.pools import HostPool
from tests.test_pools import _FakeCudart

SECRET = "0123456789abcdef0123456789abcdef"


@pytest.fixture
def fake_rocm(monkeypatch):
    """A ROCm build of torch on a GPU machine: ``torch.version.hip`` set, HIP's calls under
    the CUDA names in ``torch.cuda.cudart()`` (as torch binds them), calls recorded."""
    log = []
    cudart = _FakeCudart(log)
    monkeypatch.setattr(torch.version, "hip", "6.2.41133", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "cudart", lambda: cudart)
    monkeypatch.setattr(torch.cuda, "synchronize",
                        lambda device=None: log.append(("synchronize", device)))
    cleared = []
    monkeypatch.setattr(host_register, "clear_last_error",
                        lambda runtime=None, **kw: cleared.append(runtime) or True)
    return log, cudart, cleared


def test_the_runtime_follows_the_torch_build(monkeypatch):
    monkeypatch.setattr(torch.version, "hip", None, raising=False)
    assert host_register.current_runtime() is CUDA
    monkeypatch.setattr(torch.version, "hip", "6.2", raising=False)
    assert host_register.current_runtime() is HIP
    assert (HIP.library, HIP.get_last_error, HIP.register_flags) == (
        "libamdhip64", "hipGetLastError", 3)
    assert CUDA.registers_read_only and not HIP.registers_read_only
    assert HIP.call("cudaHostRegister") == "hipHostRegister"
    assert CUDA.call("cudaHostUnregister") == "cudaHostUnregister"


def test_the_library_is_found_in_the_memory_map(tmp_path):
    maps = tmp_path / "maps"
    maps.write_text(
        "7f00-7f01 r-xp 00000000 08:01 1 /opt/rocm-6.2/lib/libamdhip64.so.6.2.41133\n"
        "7f01-7f02 r--p 00001000 08:01 1 /opt/rocm-6.2/lib/libamdhip64.so.6.2.41133\n"
        "7f02-7f03 r-xp 00000000 08:01 2 /usr/lib/libcudart_static_not.so\n"
        "7f03-7f04 rw-p 00000000 00:00 0 [heap]\n"
        "7f04-7f05 r-xp 00000000 08:01 3 /usr/local/cuda/lib64/libcudart.so.12\n"
        "7f05-7f06 r-xp 00000000 08:01 4 /home/x/libamdhip64_tools/other.so\n")
    assert host_register.find_loaded_library("libamdhip64", str(maps)) == [
        "/opt/rocm-6.2/lib/libamdhip64.so.6.2.41133"]
    assert host_register.find_loaded_library("libcudart", str(maps)) == [
        "/usr/lib/libcudart_static_not.so", "/usr/local/cuda/lib64/libcudart.so.12"]
    assert host_register.find_loaded_library("libamdhip64", str(tmp_path / "none")) == []


def test_the_last_error_is_reset_in_the_runtimes_own_library(tmp_path, caplog):
    maps = tmp_path / "maps"
    maps.write_text("7f00-7f01 r-xp 0 08:01 1 /opt/rocm/lib/libamdhip64.so.6\n"
                    "7f02-7f03 r-xp 0 08:01 3 /usr/local/cuda/lib64/libcudart.so.12\n")
    calls = []

    class Library:
        def __init__(self, path):
            self.path = path

        def __getattr__(self, name):
            return lambda: calls.append((self.path, name))

    assert host_register.clear_last_error(HIP, maps=str(maps), load=Library)
    assert host_register.clear_last_error(CUDA, maps=str(maps), load=Library)
    assert calls == [("/opt/rocm/lib/libamdhip64.so.6", "hipGetLastError"),
                     ("/usr/local/cuda/lib64/libcudart.so.12", "cudaGetLastError")]
    maps.write_text("")
    with caplog.at_level("WARNING", logger="hisparse_triton.worker.host_register"):
        assert not host_register.clear_last_error(HIP, maps=str(maps), load=Library)
    assert "libamdhip64 not found" in caplog.text


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler for the stand-in")
def test_the_last_error_reset_calls_a_real_stand_in_library(tmp_path):
    """A shared library named like HIP's, loaded into this process, exporting the call."""
    source = tmp_path / "standin.c"
    source.write_text("static int calls;\n"
                      "int hipGetLastError(void) { return ++calls; }\n"
                      "int standin_calls(void) { return calls; }\n")
    library = tmp_path / f"libamdhip64-standin-{uuid.uuid4().hex}.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
    loaded = ctypes.CDLL(str(library))
    assert str(library) in host_register.find_loaded_library("libamdhip64")
    assert host_register.clear_last_error(HIP)
    assert loaded.standin_calls() >= 1


def test_a_torch_build_without_the_bindings_is_a_clear_error(fake_rocm, monkeypatch):
    class NoRegistration:
        def cudaGetErrorString(self, err):  # noqa: N802
            return "x"

    monkeypatch.setattr(torch.cuda, "cudart", lambda: NoRegistration())
    with pytest.raises(HostMemoryError, match=r"this torch build \(HIP\) does not bind "
                                              r"hipHostRegister, hipHostUnregister"):
        HostPool(4096)
    assert not HostPool(4096, pin=False).pinned        # only an explicit pin=False skips it


def test_rocm_pins_a_private_pool_through_torchs_bindings(fake_rocm):
    log, cudart, _ = fake_rocm
    with HostPool(8192) as pool:
        assert pool.pinned
        assert log == [("register", pool.data_ptr, 8192, 3)]
    assert [c[0] for c in log] == ["register", "synchronize", "unregister"]


def test_rocm_maps_an_attached_rank_read_write_and_its_tensors_still_refuse_writes(fake_rocm):
    log, _, _ = fake_rocm
    name = f"test-{os.getpid()}-{uuid.uuid4().hex}"
    with HostPool(4096, shared_name=name, create=True, secret=SECRET) as pool:
        with HostPool(4096, shared_name=name, create=False, secret=SECRET) as other:
            assert other.pinned and other.writable and other.read_only
            # No read-only flag on HIP: both registrations are portable | mapped.
            assert [c[3] for c in log if c[0] == "register"] == [3, 3]
            pool.tensor[5] = 3
            assert int(other.tensor[5]) == 3
            with pytest.raises(ReadOnlyViewError):
                other.tensor[5] = 4


def test_a_failed_hip_registration_names_hip_and_resets_its_error(fake_rocm):
    log, cudart, cleared = fake_rocm
    cudart.fail = 2
    with pytest.raises(HostMemoryError, match=r"hipHostRegister of the 4096 B .* failed with "
                                              r"hipError 2 \(error 2\)"):
        HostPool(4096)
    assert cleared == [HIP]
