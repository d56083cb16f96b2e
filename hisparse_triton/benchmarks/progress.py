"""A minimal progress bar on stderr (used by ``bench`` and ``tune``)."""

from __future__ import annotations

import sys
from typing import Optional, TextIO


class Progress:
    """Redrawn in place on a terminal, one line per 10 % otherwise; silent when ``enabled`` is
    false. ``step(note)`` counts one unit of ``total``."""

    def __init__(self, total: int, label: str, *, stream: Optional[TextIO] = None,
                 enabled: bool = True) -> None:
        self.total = max(total, 1)
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.done = 0
        self._tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self._last_decile = -1

    def step(self, note: str = "") -> None:
        self.done = min(self.done + 1, self.total)
        if not self.enabled:
            return
        frac = self.done / self.total
        if self._tty:
            width = 30
            bar = "#" * int(frac * width) + "." * (width - int(frac * width))
            self.stream.write(f"\r{self.label} [{bar}] {self.done}/{self.total} {note[:40]:<40}")
            if self.done == self.total:
                self.stream.write("\n")
            self.stream.flush()
        else:
            decile = int(frac * 10)
            if decile != self._last_decile or self.done == self.total:
                self._last_decile = decile
                self.stream.write(f"{self.label}: {self.done}/{self.total} {note}\n")
                self.stream.flush()
