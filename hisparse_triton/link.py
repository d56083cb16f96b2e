"""The host -> device link speed the tools assume when none is given (no torch, no numpy).

``simulate`` turns its bytes moved into transfer time with it and ``advise`` its gathers into
link time per decode step, unless ``--link-gbps`` (or ``advise --bench-json``, a GPU gather
result of ``bench``) says otherwise.

The default is not a figure of this project: it is the middle of published row-gather
measurements of 656-byte rows (the fp8 MLA row of DeepSeek-V3.2 and GLM-5) over PCIe Gen5,
31 GB/s (SGLang's host -> device swap-in of KV rows) to 37 GB/s (a UVA gather kernel reading
pinned host memory from the SMs), both below the ~55 GB/s of a contiguous copy-engine copy:
a gather of scattered rows does not reach the link's contiguous speed.
"""

from __future__ import annotations

#: GB/s (decimal) of a host -> device gather of 656 B rows when nothing better is known.
DEFAULT_LINK_GBPS = 34.0
#: The measured range the default sits in, GB/s.
MEASURED_ROW_GATHER_GBPS = (31.0, 37.0)
#: Where the default comes from, in one line (printed next to every figure that uses it).
DEFAULT_LINK_SOURCE = "default: published 656 B row gathers over PCIe Gen5 take 31-37 GB/s"

__all__ = ["DEFAULT_LINK_GBPS", "DEFAULT_LINK_SOURCE", "MEASURED_ROW_GATHER_GBPS"]
