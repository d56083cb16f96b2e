"""A dense oracle for the runtime: every (request, layer, position) row kept on the side.

``DenseOracle`` writes random KV bytes through the runtime (at the rows ``append_slots``
returns, as a model would), keeps a dense CPU copy of every row, and checks that

- every row id ``resolve`` returns points at bytes equal to the dense copy for that
  (request, layer, position), for the leader and every follower of the index group, and is
  -1 exactly where the position is invalid (negative or ``>= seq_len``);
- the device layers that keep the full history (indexer, regular) and the resident pages
  of sparse layers still hold the dense bytes (no two groups share a block).

It is the exactness check of ``hisparse-triton simulate --verify`` and of the tests. Checks
read device memory (a device sync on CUDA): a verification tool, not a serving path.

By default the KV bytes are random (a generator seeded by ``seed``). With prefix reuse the
bytes of a shared position must be the same for every request sharing it (a model computes
the same KV from the same tokens): pass ``content`` (e.g. built on ``position_bytes``), and a
request admitted with a cached prefix starts with that prefix's rows (``add(id,
cached_tokens)``), which the runtime adopted instead of having them written again.
"""

from __future__ import annotations

from typing import Callable, Hashable, Optional, Sequence

import torch

from hisparse_triton.layout import underlying_layer_name


class OracleMismatch(AssertionError):
    """A row the runtime points at differs from the dense copy."""


class SplitView:
    """The part of the ``HiSparseRuntime`` API ``DenseOracle`` reads, over a scheduler and a
    worker driven separately (as a serving stack drives them)."""

    def __init__(self, scheduler, worker) -> None:
        self.scheduler, self.worker = scheduler, worker
        self.device_layers = scheduler.device_layers
        self.source_layers = scheduler.source_layers
        self.max_num_seqs = scheduler.max_num_seqs
        self.max_model_len = scheduler.max_model_len
        self.device = worker.device

    def state_row(self, request_id: Hashable) -> int:
        return self.scheduler.state_row(request_id)

    def block_table(self, request_id: Hashable, layer: str) -> list[int]:
        return self.scheduler.block_table(request_id, layer)

    def host_block_table(self, request_id: Hashable) -> list[int]:
        return self.scheduler.host_block_table(request_id)

    def index_group(self, leader: str) -> tuple[str, ...]:
        return self.worker.index_group(leader)

    def device_cache(self, layer: str) -> torch.Tensor:
        return self.worker.device_cache(layer)

    def host_cache(self, layer: str) -> torch.Tensor:
        return self.worker.host_cache(layer)


#: ``content(request_id, layer, positions [n] int64, row_bytes) -> [n, row_bytes] uint8``.
Content = Callable[[Hashable, str, torch.Tensor, int], torch.Tensor]


def position_bytes(key: int | torch.Tensor, layer: int, positions: torch.Tensor,
                   row_bytes: int) -> torch.Tensor:
    """``[n, row_bytes] uint8``: pseudo-random bytes that are a pure function of ``key``
    (an int, or one int64 per position), ``layer`` and each position (``positions [n]``
    int64), with no state: the same on every call, rank and request that passes the same
    key."""
    base = (key * 1_000_003 + layer * 7_919 + positions.to(torch.int64) * 104_729)[:, None]
    mixed = (base * 6_364_136_223_846_793_005
             + torch.arange(row_bytes, dtype=torch.int64) * 1_442_695_040_888_963_407)
    return ((mixed >> 40) & 0xFF).to(torch.uint8)


class DenseOracle:
    """Dense copies of every device layer's rows (``runtime``: a ``HiSparseRuntime``, or a
    ``SplitView`` of a scheduler and a worker).

    Per layer one CPU tensor ``[max_num_seqs, max_model_len, row_bytes] uint8`` indexed by
    the request's state row, so a whole batch is checked with one gather per layer.
    ``content``: what KV bytes a (request, layer, positions) holds (module docstring);
    default: random bytes drawn from ``seed``.
    """

    def __init__(self, runtime, seed: int = 0, content: Optional[Content] = None) -> None:
        self.runtime = runtime
        self._gen = torch.Generator().manual_seed(seed)
        self._content = content
        self._layers = list(runtime.device_layers)
        self._row_bytes = {layer: runtime.device_cache(layer).shape[-1] for layer in self._layers}
        shape = (runtime.max_num_seqs, runtime.max_model_len)
        self._dense = {layer: torch.zeros(*shape, self._row_bytes[layer], dtype=torch.uint8)
                       for layer in self._layers}
        self._row: dict[Hashable, int] = {}
        self._len: dict[Hashable, int] = {}
        self.rows_checked = 0

    def add(self, request_id: Hashable, cached_tokens: int = 0) -> None:
        """Start a dense copy for a request just added to the runtime; ``cached_tokens``:
        the prefix ``add_request`` reported cached (its rows come from ``content``, which is
        then required)."""
        if cached_tokens and self._content is None:
            raise ValueError(f"request {request_id!r} starts with {cached_tokens} cached tokens: "
                             f"the oracle needs a content function to know their bytes.")
        row = self.runtime.state_row(request_id)
        for layer, dense in self._dense.items():
            dense[row].zero_()
            if cached_tokens:
                dense[row, :cached_tokens] = self._bytes(request_id, layer, 0, cached_tokens)
        self._row[request_id] = row
        self._len[request_id] = cached_tokens

    def _bytes(self, request_id: Hashable, layer: str, start: int, n: int) -> torch.Tensor:
        if self._content is None:
            return torch.randint(0, 256, (n, self._row_bytes[layer]), dtype=torch.uint8,
                                 generator=self._gen)
        positions = torch.arange(start, start + n, dtype=torch.int64)
        return self._content(request_id, layer, positions, self._row_bytes[layer])

    def free(self, request_id: Hashable) -> None:
        self._row.pop(request_id, None)
        self._len.pop(request_id, None)

    def truncate(self, request_id: Hashable, new_len: int) -> None:
        """Keep the request's first ``new_len`` tokens (after the runtime's ``truncate`` or
        a ``verify_drafts`` that rejected some); a later ``write`` continues from there."""
        if not 0 <= new_len <= self._len[request_id]:
            raise ValueError(f"request {request_id!r}: truncate to {new_len} tokens, it holds "
                             f"{self._len[request_id]}.")
        self._len[request_id] = new_len

    def dense_rows(self, request_id: Hashable, layer: str) -> torch.Tensor:
        """``[seq_len, row_bytes] uint8``: what the request's layer holds, position by position."""
        return self._dense[layer][self._row[request_id], :self._len[request_id]]

    def write(self, request_id: Hashable, rows: dict[str, torch.Tensor]) -> None:
        """Write the KV bytes (``content``, or random) of the tokens ``append_slots`` just
        returned ``rows`` for."""
        row = self._row[request_id]
        start = self._len[request_id]
        rows = {layer: torch.as_tensor(r) for layer, r in rows.items()}
        n = next(iter(rows.values())).numel()
        for layer in self._layers:
            data = self._bytes(request_id, layer, start, n)
            self._dense[layer][row, start:start + n] = data
            cache = self.runtime.device_cache(layer)
            block_size = cache.shape[1]
            r = rows[layer].to(cache.device)
            cache[r // block_size, r % block_size] = data.to(cache.device)
        self._len[request_id] = start + n

    def check_resolve(self, leader: str, request_ids: Sequence[Optional[Hashable]],
                      topk: torch.Tensor, rows: torch.Tensor) -> None:
        """``OracleMismatch`` unless ``rows`` (from ``resolve``) matches the dense copies."""
        topk = topk.detach().to("cpu", torch.int64)
        rows = rows.detach().to("cpu", torch.int64)
        if rows.shape != topk.shape:
            raise OracleMismatch(f"resolve returned shape {tuple(rows.shape)} for top-k "
                                 f"{tuple(topk.shape)}.")
        lengths = torch.tensor([self._len[r] if r is not None else 0 for r in request_ids],
                               dtype=torch.int64)
        state = torch.tensor([self._row[r] if r is not None else 0 for r in request_ids],
                             dtype=torch.int64)
        valid = (topk >= 0) & (topk < lengths[:, None])
        wrong = (rows < 0) != ~valid
        wrong |= ~valid & (rows != -1)
        if bool(wrong.any()):
            r, c = (int(v) for v in torch.nonzero(wrong)[0])
            raise OracleMismatch(
                f"request {request_ids[r]!r} (seq_len {int(lengths[r])}), leader {leader}: "
                f"column {c} position {int(topk[r, c])} resolved to row {int(rows[r, c])}.")
        if not bool(valid.any()):
            return
        batch, col = torch.nonzero(valid, as_tuple=True)
        vrows, vpos = rows[batch, col], topk[batch, col]
        layers = self.runtime.index_group(leader)
        for layer in layers:
            cache = self.runtime.device_cache(layer)
            block_size = cache.shape[1]
            num_rows = cache.shape[0] * block_size
            if bool((vrows >= num_rows).any()):
                raise OracleMismatch(f"leader {leader}: row {int(vrows.max())} is outside the "
                                     f"device pool ({num_rows} rows).")
            actual = cache[(vrows // block_size).to(cache.device),
                           (vrows % block_size).to(cache.device)].cpu()
            expected = self._dense[layer][state[batch], vpos]
            if not torch.equal(actual, expected):
                i = int((actual != expected).any(dim=1).nonzero()[0])
                raise OracleMismatch(
                    f"request {request_ids[int(batch[i])]!r}, layer {layer} (leader {leader}): "
                    f"position {int(vpos[i])} -> row {int(vrows[i])} holds other bytes than "
                    f"the dense copy.")
        self.rows_checked += int(vrows.numel()) * len(layers)

    def check_pages(self, request_id: Hashable) -> None:
        """``OracleMismatch`` unless every page the request holds on the GPU matches."""
        length = self._len[request_id]
        for layer in self._layers:
            cache = self.runtime.device_cache(layer)
            block_size = cache.shape[1]
            blocks = torch.tensor(self.runtime.block_table(request_id, layer), dtype=torch.int64)
            if blocks.numel() == 0:
                continue
            pos = torch.arange(min(length, blocks.numel() * block_size))
            page_blocks = blocks[pos // block_size]
            held = page_blocks > 0
            if not bool(held.any()):
                continue
            b, o = page_blocks[held], (pos % block_size)[held]
            actual = cache[b.to(cache.device), o.to(cache.device)].cpu()
            expected = self.dense_rows(request_id, layer)[pos[held]]
            if not torch.equal(actual, expected):
                raise OracleMismatch(f"request {request_id!r}, layer "
                                     f"{underlying_layer_name(layer)}: a page on the GPU holds "
                                     f"other bytes than the dense copy.")

    def check_host(self, request_id: Hashable, committed_tokens: int) -> None:
        """``OracleMismatch`` unless the host pool holds the first ``committed_tokens`` rows of
        every source layer (syncs the device first on CUDA)."""
        if self.runtime.device.type == "cuda":
            torch.cuda.synchronize(self.runtime.device)
        blocks = torch.tensor(self.runtime.host_block_table(request_id), dtype=torch.int64)
        pos = torch.arange(committed_tokens)
        for layer in self.runtime.source_layers:
            host = self.runtime.host_cache(layer)
            block_size = host.shape[1]
            actual = host[blocks[pos // block_size], pos % block_size]
            if not torch.equal(actual, self.dense_rows(request_id, layer)[:committed_tokens]):
                raise OracleMismatch(f"request {request_id!r}, layer {layer}: the host pool "
                                     f"does not hold the committed rows.")
