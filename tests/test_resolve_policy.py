"""The replacement policy seam: the kernel's ``_lru_replacement`` (launched alone through
``kernels.resolve_policy.lru_replacement``) and its torch twin ``reference.lru_replacement``
agree bit for bit, on random classes (valid, serving, invalid positions) and fill counts,
with one tile per row and with several (the carries)."""

from __future__ import annotations

import pytest
import torch

from hisparse_triton.kernels import resolve_policy
from hisparse_triton.ops.resolve import reference


def twin(cls: torch.Tensor, misses: torch.Tensor):
    evict, serving = cls == 0, cls == 1
    n_fill = torch.minimum(misses.to(torch.int64)[:, None], evict.sum(1, keepdim=True))
    return reference.lru_replacement(evict, serving, n_fill)


@pytest.mark.parametrize("H, block", [(16, 16), (40, 16), (100, 32), (64, 64)])
def test_kernel_policy_matches_torch_twin(H: int, block: int) -> None:
    g = torch.Generator().manual_seed(H * 7 + block)
    R = 6
    # class mix per row: row 0 all evictable, row 1 all serving, the rest random
    cls = torch.multinomial(torch.tensor([0.6, 0.3, 0.1]), R * H, replacement=True,
                            generator=g).view(R, H).to(torch.int32)
    cls[0] = 0
    cls[1] = 1
    misses = torch.randint(0, H + 5, (R,), generator=g, dtype=torch.int32)
    misses[0] = H  # every evictable slot fills
    new_pos, filled, erank = resolve_policy.lru_replacement(cls, misses, block=block)
    want_pos, want_filled, want_erank = twin(cls, misses)
    assert torch.equal(filled, want_filled)
    assert torch.equal(new_pos.to(torch.int64), want_pos)
    # erank is meaningful at evictable positions (both define it as the running count - 1)
    ev = cls == 0
    assert torch.equal(erank.to(torch.int64)[ev], want_erank[ev])
    # the new order is a permutation of the positions
    assert torch.equal(new_pos.sort(1).values, torch.arange(H, dtype=torch.int32).expand(R, H))


def test_policy_launcher_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="cls"):
        resolve_policy.lru_replacement(torch.zeros(2, 4, dtype=torch.int64),
                                       torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="misses"):
        resolve_policy.lru_replacement(torch.zeros(2, 4, dtype=torch.int32),
                                       torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="block"):
        resolve_policy.lru_replacement(torch.zeros(2, 4, dtype=torch.int32),
                                       torch.zeros(2, dtype=torch.int32), block=24)
