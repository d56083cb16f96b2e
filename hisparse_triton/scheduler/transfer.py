"""Where a request's KV bytes go and come from in prefill/decode disaggregation (no torch).

A prefill node computes a prompt's KV; a decode node receives it, through any transport (a
copy, RDMA into registered memory), and decodes. The decode side's scheduler reserves the
request's memory and says, per layer, where each prompt token's bytes go (``KVImport``,
from ``HiSparseScheduler.import_request``); the prefill side's says where a finished
request's bytes live (``KVExport``, from ``export_request``). Both name rows the way the
runtime does everywhere: host row ``g`` is row ``g % B`` of host block ``g // B`` of every
source layer's ``host_cache``; device row ``r`` of a layer is row ``r % B`` of block
``r // B`` of its ``device_cache`` (``B``: the layer's block size). ``KVImport.copies``
pairs the two: one ``RowCopy`` per layer and pool, the rows a transport moves.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable

import numpy as np


@dataclass(frozen=True)
class RowCopy:
    """Rows a transport copies for one layer: ``src_rows[i]`` of the prefill side's
    ``layer`` (its host pool when ``src_host``, else its device pool) into ``dst_rows[i]``
    of the decode side's (host pool when ``dst_host``); both ``[n] int64``."""

    layer: str
    src_host: bool
    src_rows: np.ndarray
    dst_host: bool
    dst_rows: np.ndarray


@dataclass(frozen=True)
class KVExport:
    """Where the KV of a request's first ``num_tokens`` tokens lives on the prefill side
    (``HiSparseScheduler.export_request``).

    - ``host_rows [num_tokens] int64``: the host row of every position, for every source
      (sparse) layer: the host pool holds them all (every token is durable).
    - ``device_rows``: every other device layer (indexer, regular) -> ``[num_tokens] int64``
      device rows of its positions; -1 where a sliding-window layer released the page (no
      future query reads it).
    - ``source_layers``: the sparse layers ``host_rows`` serves.
    """

    request_id: Hashable
    num_tokens: int
    host_rows: np.ndarray
    device_rows: dict[str, np.ndarray]
    source_layers: tuple[str, ...]


@dataclass(frozen=True)
class KVImport:
    """Where a transport writes the prompt KV of a request admitted by
    ``HiSparseScheduler.import_request`` on the decode side.

    Positions ``[cached_len, prompt_len)`` are written (the first ``cached_len`` came from
    the decode side's prefix cache). For every source (sparse) layer, positions
    ``[cached_len, tail_start)`` go to the host pool at ``host_rows`` (the same rows for
    every source layer) and positions ``[tail_start, prompt_len)`` (the resident tail: the
    pages new tokens are appended to) to the layer's device rows ``device_rows[layer]``.
    Every other device layer (indexer, regular) gets all its positions ``[cached_len,
    prompt_len)`` in its device rows ``device_rows[layer]``. All arrays are ``int64``.
    """

    request_id: Hashable
    state_row: int
    cached_len: int
    tail_start: int
    prompt_len: int
    host_rows: np.ndarray
    device_rows: dict[str, np.ndarray]
    source_layers: tuple[str, ...] = field(default=())

    def device_start(self, layer: str) -> int:
        """The position of ``device_rows[layer][0]``: ``tail_start`` for a source layer,
        ``cached_len`` for any other (``KeyError`` for a layer that is not a device layer)."""
        if layer not in self.device_rows:
            raise KeyError(f"{layer!r} is not a device layer of this import.")
        return self.tail_start if layer in self.source_layers else self.cached_len

    def copies(self, export: KVExport) -> list[RowCopy]:
        """The rows to move from ``export`` (the prefill side's request, at least
        ``prompt_len`` tokens) to this import, per layer: the source layers' host part (host
        -> host) and tail (host -> device), every other layer's positions (device ->
        device; positions the prefill side no longer keeps, -1 there, are left out: no
        query reads them). ``ValueError`` when ``export`` holds fewer tokens or other layers.
        """
        if export.num_tokens < self.prompt_len:
            raise ValueError(f"the export holds {export.num_tokens} tokens of request "
                             f"{export.request_id!r}; the import needs {self.prompt_len}.")
        others = set(self.device_rows) - set(self.source_layers)
        if set(export.source_layers) != set(self.source_layers) \
                or set(export.device_rows) != others:
            raise ValueError("the export and the import name different layers: both sides "
                             "must run the same model plan.")
        host, tail = slice(self.cached_len, self.tail_start), slice(self.tail_start,
                                                                   self.prompt_len)
        out = []
        for layer in self.source_layers:
            if self.tail_start > self.cached_len:
                out.append(RowCopy(layer, True, export.host_rows[host], True, self.host_rows))
            if self.prompt_len > self.tail_start:
                out.append(RowCopy(layer, True, export.host_rows[tail], False,
                                   self.device_rows[layer]))
        for layer in (name for name in self.device_rows if name in others):
            src = export.device_rows[layer][self.cached_len:self.prompt_len]
            keep = src >= 0
            out.append(RowCopy(layer, False, src[keep], False, self.device_rows[layer][keep]))
        return out


__all__ = ["KVExport", "KVImport", "RowCopy"]
