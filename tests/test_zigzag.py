"""Zigzag layout, single process: the permuted batch equals the one built from the chunk
definition (``tests.common.expected_zigzag_batch``), every key permuted (loss_mask included)."""

import pytest
import torch

from megatron_tsp.core import zigzag
from tests.common import expected_zigzag_batch, natural_order, zigzag_positions, zigzag_rows


def _batch(seed, batch=2, seq=48, vocab=97):
    g = torch.Generator().manual_seed(seed)
    pos = torch.arange(seq).unsqueeze(0).expand(batch, seq).contiguous()
    return {
        "tokens": torch.randint(0, vocab, (batch, seq), generator=g),
        "labels": torch.randint(0, vocab, (batch, seq), generator=g),
        "loss_mask": (torch.rand(batch, seq, generator=g) > 0.3).float(),
        "position_ids": pos,
        "attention_mask": torch.triu(torch.ones(seq, seq, dtype=torch.bool), 1)
        .expand(batch, 1, seq, seq)
        .contiguous(),
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
    chunk = 48 // (2 * d)
    for r in range(d):
        part = zigzag.split(x, d, r, dim=1)
        assert torch.equal(part, permuted.chunk(d, dim=1)[r]), f"seed={seed}"
        # chunks r and 2D-1-r, written out
        positions = list(range(r * chunk, (r + 1) * chunk))
        positions += list(range((2 * d - 1 - r) * chunk, (2 * d - r) * chunk))
        assert torch.equal(part, x[:, positions]), f"seed={seed}"
        # the tests' own reference helper agrees with the definition written out here
        assert torch.equal(zigzag_rows(x, d, r, dim=1), x[:, positions]), f"seed={seed}"
    assert torch.equal(natural_order(permuted, d, dim=1), x), f"seed={seed}"


@pytest.mark.parametrize("d", [1, 2, 3, 4])
def test_unpermute_inverts_permute(seed, d):
    x = torch.randn(3, 24, 2, generator=torch.Generator().manual_seed(seed))
    permuted = zigzag.permute(x, d, dim=1)
    assert torch.equal(permuted, expected_zigzag_batch({"x": x}, d)["x"]), f"seed={seed}"
    assert torch.equal(zigzag.unpermute(permuted, d, dim=1), x), f"seed={seed}"
    out = torch.empty_like(x)
    zigzag.permute_into(x, d, 1, out)
    assert torch.equal(out, permuted)
    zigzag.unpermute_into(permuted, d, 1, out)
    assert torch.equal(out, x)


@pytest.mark.parametrize("d", [2, 4])
def test_batch_with_documents(seed, d):
    """A causal mask (one document) is permuted as before; a document mask comes back as the
    documents in natural positions (a ``DocumentMaskTensor``, never permuted), the other keys
    permuted and marked for the batch guard; ``check_single_document=False`` passes the mask
    through untouched."""
    from megatron_tsp.core.batch_guard import zigzag_mark
    from megatron_tsp.core.documents import DocumentMask, DocumentMaskTensor, as_documents

    s = 32
    tokens = torch.randint(0, 9, (2, s), generator=torch.Generator().manual_seed(seed))
    causal = torch.triu(torch.ones(s, s, dtype=torch.bool), 1).expand(2, 1, s, s)
    out = zigzag.get_batch_on_this_tsp_rank({"tokens": tokens, "attention_mask": causal}, d)
    p = zigzag_positions(s, d)  # the mask's rows and columns both in gathered order
    assert torch.equal(out["attention_mask"], causal[:, :, p][:, :, :, p])
    documents = DocumentMask.from_document_starts([[0, 3, 17], [0, 30]], s)
    batch = {"tokens": tokens, "attention_mask": documents.dense_mask()}
    out = zigzag.get_batch_on_this_tsp_rank(batch, d)
    assert isinstance(out["attention_mask"], DocumentMaskTensor)
    assert as_documents(out["attention_mask"]) == documents
    assert torch.equal(out["tokens"], zigzag.permute(tokens, d, dim=1))
    assert zigzag_mark(out["tokens"]) == d
    out = zigzag.get_batch_on_this_tsp_rank(batch, d, check_single_document=False)
    assert out["attention_mask"] is not None and not isinstance(
        out["attention_mask"], DocumentMaskTensor
    )
