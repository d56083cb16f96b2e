"""Where the numbers come from: GPU, driver, clocks, library versions, commit."""

from __future__ import annotations

import os
import platform
import subprocess
from typing import Any, Optional

#: ``nvidia-smi --query-gpu`` fields -> JSON keys. Queried together; when the driver rejects
#: one field the query is retried with ``_SMI_MINIMAL`` only.
_SMI_FIELDS = {
    "name": "name", "driver_version": "driver", "pcie.link.gen.max": "pcie_gen_max",
    "pcie.link.width.max": "pcie_width_max", "pcie.link.gen.current": "pcie_gen_current",
    "pcie.link.width.current": "pcie_width_current", "clocks.sm": "sm_clock_mhz",
    "clocks.max.sm": "sm_clock_max_mhz", "clocks.mem": "mem_clock_mhz", "pstate": "pstate",
    "temperature.gpu": "temperature_c", "power.draw": "power_w",
    "memory.used": "memory_used_mib",
}
_SMI_MINIMAL = ("name", "driver_version")


def _git_commit() -> Optional[str]:
    try:
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))
        out = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True,
                             text=True, timeout=5)
        return (out.stdout.strip() or None) if out.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None


def rocm_smi() -> dict[str, Any]:
    """GPU 0 as ``rocm-smi --json`` reports it (product, driver, PCIe bus, clocks), keys as
    the tool names them; ``{}`` when ``rocm-smi`` is missing or fails."""
    import json

    try:
        out = subprocess.run(["rocm-smi", "--showproductname", "--showdriverversion",
                              "--showbus", "--showclocks", "--json"],
                             capture_output=True, text=True, timeout=20)
        data = json.loads(out.stdout) if out.returncode == 0 else {}
    except (OSError, subprocess.SubprocessError, ValueError):
        return {}
    card = data.get("card0", {}) if isinstance(data, dict) else {}
    system = data.get("system", {}) if isinstance(data, dict) else {}
    return {**system, **card} if isinstance(card, dict) and isinstance(system, dict) else {}


def _smi_query(names: tuple[str, ...]) -> Optional[list[str]]:
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={','.join(names)}",
                              "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0 or not out.stdout.strip():
        return None
    return [f.strip() for f in out.stdout.strip().splitlines()[0].split(",")]


def nvidia_smi() -> dict[str, Any]:
    """GPU 0 as ``nvidia-smi`` reports it (name, driver, PCIe link, clocks, power); ``{}``
    when ``nvidia-smi`` is missing or fails."""
    names = tuple(_SMI_FIELDS)
    values = _smi_query(names)
    if values is None or len(values) != len(names):
        names = _SMI_MINIMAL
        values = _smi_query(names)
        if values is None:
            return {}
    return {_SMI_FIELDS[n]: v for n, v in zip(names, values)
            if v and v not in ("[N/A]", "N/A", "[Not Supported]")}


def environment() -> dict[str, Any]:
    """GPU name, driver, torch, triton, CUDA runtime and driver API (or on a ROCm build of
    torch: HIP version, gfx target, CU count, ``rocm-smi``), SM count, L2 size, clocks,
    Python, host, git commit."""
    import torch
    import triton

    from hisparse_triton import __version__

    env: dict[str, Any] = {
        "hisparse_triton": __version__,
        "git_commit": _git_commit(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda_available": torch.cuda.is_available(),
        "triton_interpret": os.environ.get("TRITON_INTERPRET") == "1",
        "gpu": None,
        "driver": None,
    }
    hip = getattr(torch.version, "hip", None)  # a ROCm build: torch.cuda is HIP there
    env["vendor"] = "amd" if hip else "nvidia"
    if torch.cuda.is_available() and hip:
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        env.update({
            "gpu": props.name,
            "gpu_count": torch.cuda.device_count(),
            "gcn_arch": getattr(props, "gcnArchName", None),  # gfx942:sramecc+:xnack-
            "sm_count": props.multi_processor_count,  # CUs on ROCm (the grid budget's unit)
            "cu_count": props.multi_processor_count,
            "warp_size": getattr(props, "warp_size", None),
            "gpu_memory_bytes": props.total_memory,
            "l2_cache_bytes": getattr(props, "L2_cache_size", None),
            "hip_runtime": hip,
            "rocm_smi": rocm_smi(),
        })
    elif torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        smi = nvidia_smi()
        env.update({
            "gpu": props.name,
            "gpu_count": torch.cuda.device_count(),
            "compute_capability": f"{props.major}.{props.minor}",
            "sm_count": props.multi_processor_count,
            "gpu_memory_bytes": props.total_memory,
            "l2_cache_bytes": getattr(props, "L2_cache_size", None),
            "cuda_runtime": torch.version.cuda,
            "driver": smi.get("driver"),
            "nvidia_smi": smi,
        })
        try:
            version = torch._C._cuda_getDriverVersion()  # e.g. 13000 = CUDA 13.0
            env["cuda_driver_api"] = f"{version // 1000}.{version % 1000 // 10}"
        except Exception:  # noqa: BLE001 - private API, informational only
            pass
    return env
