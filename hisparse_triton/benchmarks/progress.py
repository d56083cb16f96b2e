"""The one progress bar of the CLI (``simulate``, ``bench``, ``tune``, ``advise``): a tqdm bar
on stderr with the count, the rate and an ETA, e.g.
``simulate:  42%|########          | 54/128 [00:05<00:07, 10.1 step/s]``.

``default_enabled(flag)``: what ``--progress`` / ``--no-progress`` / neither mean (neither = on
when stderr is a terminal), the same in every command.
"""

from __future__ import annotations

import sys
from typing import Optional, TextIO

BAR_FORMAT = ("{desc}: {percentage:3.0f}%|{bar:20}| {n_fmt}/{total_fmt} "
              "[{elapsed}<{remaining}, {rate_fmt}]{postfix}")


def default_enabled(flag: Optional[bool], stream: Optional[TextIO] = None) -> bool:
    """``flag`` when given, else whether ``stream`` (default stderr) is a terminal."""
    if flag is not None:
        return bool(flag)
    stream = stream if stream is not None else sys.stderr
    return bool(getattr(stream, "isatty", lambda: False)())


class Progress:
    """A bar of ``total`` units labelled ``label``; ``step(note)`` counts one unit (``note``
    is shown after the bar), ``close()`` ends the line. Silent when ``enabled`` is false.
    ``done`` / ``total`` are the counts so far."""

    def __init__(self, total: int, label: str, *, stream: Optional[TextIO] = None,
                 enabled: bool = True, unit: str = "step") -> None:
        self.total = max(int(total), 1)
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.done = 0
        self._bar = None
        if enabled:
            from tqdm import tqdm

            self._bar = tqdm(total=self.total, desc=label, file=self.stream, unit=f" {unit}",
                             bar_format=BAR_FORMAT, ascii=" #", dynamic_ncols=True,
                             mininterval=0.2, leave=True)

    def step(self, note: str = "", n: int = 1) -> None:
        n = max(0, min(n, self.total - self.done))
        self.done += n
        if self._bar is None:
            return
        if note:
            self._bar.set_postfix_str(note[:40], refresh=False)
        self._bar.update(self._bar_done_delta())
        if self.done >= self.total:
            self.close()

    def _bar_done_delta(self) -> int:
        """Units to add to the bar so that it shows ``done`` (callers may set ``done``)."""
        return max(0, self.done - self._bar.n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


__all__ = ["BAR_FORMAT", "Progress", "default_enabled"]
