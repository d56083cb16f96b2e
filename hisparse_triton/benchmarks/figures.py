"""One measured point and its JSON record."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

from hisparse_triton.benchmarks.timing import Timing


def round_sig(value: Optional[float], digits: int = 4) -> Optional[float]:
    """``value`` to ``digits`` significant digits (``None`` and non-finite values as is)."""
    if value is None or not math.isfinite(value):
        return value
    return float(f"{value:.{digits}g}")


@dataclass
class Figure:
    """One measured point: a record of ``transfers`` or ``resolve`` in the JSON.

    ``timing`` is per call (for ``triton_graph``: per captured call); ``gbps`` payload GB/s;
    ``vs_*`` ratios to the baselines of the same run; ``verified`` whether the moved bytes /
    returned state matched; ``error`` why the figure is missing or wrong."""

    op: str
    method: str
    params: dict[str, Any]
    timing: Optional[Timing] = None
    gbps: Optional[float] = None
    vs_eager: Optional[float] = None
    vs_contiguous: Optional[float] = None
    vs_torch: Optional[float] = None
    verified: Optional[bool] = None
    error: Optional[str] = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def time_us(self) -> Optional[float]:
        return None if self.timing is None else self.timing.median_ms * 1e3

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"op": self.op, "method": self.method, **self.params,
                               "time_us": round_sig(self.time_us)}
        if self.timing is not None:
            out["p20_us"] = round_sig(self.timing.p20_ms * 1e3)
            out["p80_us"] = round_sig(self.timing.p80_ms * 1e3)
            out["reps"] = self.timing.reps
            if self.timing.probe_us is not None:
                out["probe_us"] = round_sig(self.timing.probe_us)
        for name in ("gbps", "vs_eager", "vs_contiguous", "vs_torch"):
            value = getattr(self, name)
            if value is not None:
                out[name] = round_sig(value)
        if self.verified is not None:
            out["verified"] = self.verified
        if self.error is not None:
            out["error"] = self.error
        out.update(self.extra)
        return out
