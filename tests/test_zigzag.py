"""Zigzag layout, single process: the permuted batch equals the one built from the chunk
definition (``tests.common.expected_zigzag_batch``), every key permuted (loss_mask included)."""

import pytest
import torch

from megatron_tsp.core import zigzag
from tests.common import expected_zigzag_batch


def _batch(seed, batch=2, seq=48, vocab=97):
    g = torch.Generator().manual_seed(seed)
    pos = torch.arange(seq).unsqueeze(0).expand(batch, seq).contiguous()
    return {
        "tokens": torch.randint(0, vocab, (batch, seq), generator=g),
        "labels": torch.randint(0, vocab, (batch, seq), generator=g),
        "loss_mask": (torch.rand(batch, seq, generator=g) > 0.3).float(),
        "position_ids": pos,
        "attention_mask": torch.triu(torch.ones(seq, seq, dtype=torch.bool), 1).expand(
            batch, 1, seq, seq).contiguous(),
        "cu_seqlens": None,
    }


@pytest.mark.parametrize("d", [1, 2, 3, 4, 8])
def test_batch_permutation_matches_chunk_definition(seed, d):
    batch = _batch(seed)
    got = zigzag.get_batch_on_this_tsp_rank(batch, group_size=d)
    want = expected_zigzag_batch(batch, d)
    assert set(got) == set(batch)
    for key, value in want.items():
        if value is None:
            assert got[key] is None, key
        else:
            assert torch.equal(got[key], value), f"{key} is not permuted like the tokens (D={d})"


@pytest.mark.parametrize("d", [2, 4])
def test_split_is_the_contiguous_shard_of_the_permutation(seed, d):
    x = torch.randn(2, 48, 3, generator=torch.Generator().manual_seed(seed))
    permuted = expected_zigzag_batch({"x": x}, d)["x"]
    parts = [zigzag.split(x, d, r, dim=1) for r in range(d)]
    for r in range(d):
        assert torch.equal(parts[r], permuted.chunk(d, dim=1)[r])
        positions = zigzag.local_positions(48, d, r)
        assert torch.equal(parts[r], x[:, positions])
    assert torch.equal(zigzag.unsplit(parts, dim=1), x)
