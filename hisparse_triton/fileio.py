"""Writing output files: atomically (a temporary file in the same directory, then a rename)
and with the permissions ``open()`` would give (``0666 & ~umask``), not the private ``0600``
of a temporary file."""

from __future__ import annotations

import os
import tempfile
from typing import Union


def write_atomically(path: str, data: Union[bytes, str], *, suffix: str = "") -> None:
    """Replace ``path`` with ``data`` (``str`` is written as UTF-8); on any failure the
    temporary file is removed and ``path`` is left as it was."""
    payload = data.encode("utf-8") if isinstance(data, str) else data
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix=".hisparse-", suffix=suffix, dir=directory)
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(payload)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


__all__ = ["write_atomically"]
