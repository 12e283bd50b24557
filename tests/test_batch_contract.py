"""The batch contract of ``get_batch_on_this_tsp_rank`` with packed documents, on batches built
the way Megatron-LM's ``--reset-attention-mask`` / ``--reset-position-ids`` build them
(megatron-core's own ``_get_ltor_masks_and_position_ids`` on EOD-separated tokens): a document
mask (with or without restarting position ids) becomes a ``DocumentMaskTensor`` holding the
documents the EODs define; position ids that restart without a document mask, malformed masks
and multi-sample ``cu_seqlens`` raise ``PackedBatchError`` naming the key, the sample and the
row; a single document (no EOD, or the flags off) passes and permutes as before.
``check_single_causal_document`` (what the Megatron-LM hook runs on a CP rank's slice) still
refuses documents. Single process."""

import pytest
import torch
from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids

from megatron_tsp.core import batch_contract, zigzag
from megatron_tsp.core.batch_contract import PackedBatchError, natural_positions
from megatron_tsp.core.documents import DocumentMaskTensor, as_documents

EOD = 0


def _megatron_batch(seed, reset_position_ids, reset_attention_mask, eods=True, b=2, s=32):
    """A batch as Megatron-LM's GPT dataset builds it (mask True = masked, [b, 1, s, s])."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(1, 50, (b, s), generator=g)
    if eods:
        for row in range(b):  # two or three documents per sequence, boundaries anywhere
            cuts = torch.randperm(s - 2, generator=g)[: 2 + row] + 1
            tokens[row, cuts] = EOD
    masks, positions = [], []
    for row in range(b):
        mask, _, pos = _get_ltor_masks_and_position_ids(
            tokens[row], EOD, reset_position_ids, reset_attention_mask, False, True
        )
        masks.append(mask)
        positions.append(pos)
    return {
        "tokens": tokens,
        "labels": torch.roll(tokens, -1, 1),
        "loss_mask": torch.ones(b, s),
        "attention_mask": torch.stack(masks),
        "position_ids": torch.stack(positions),
    }


@pytest.mark.parametrize("d", [1, 2, 4])
def test_single_document_batches_pass(seed, d):
    # Megatron's plain batch, and the reset flags on data without an EOD: one causal document
    for batch in (
        _megatron_batch(seed, False, False),
        _megatron_batch(seed, True, True, eods=False),
    ):
        out = zigzag.get_batch_on_this_tsp_rank(batch, group_size=d)
        assert torch.equal(out["tokens"], zigzag.permute(batch["tokens"], d, dim=1)), seed


def _eod_starts(tokens):
    """Document starts Megatron's reset flags derive: 0 and every position after an EOD."""
    return tuple(
        tuple([0] + [i + 1 for i in (row == EOD).nonzero().flatten().tolist() if i + 1 < len(row)])
        for row in tokens
    )


@pytest.mark.parametrize("reset_position_ids", [True, False])
@pytest.mark.parametrize("d", [1, 2, 4])
def test_document_mask_becomes_documents(seed, d, reset_position_ids):
    batch = _megatron_batch(seed, reset_position_ids, True)
    out = zigzag.get_batch_on_this_tsp_rank(batch, group_size=d)
    assert isinstance(out["attention_mask"], DocumentMaskTensor)
    documents = as_documents(out["attention_mask"])
    assert documents.starts == _eod_starts(batch["tokens"]), seed
    # the other keys permute as before, the position ids as they came (restarting or not)
    assert torch.equal(out["position_ids"], zigzag.permute(batch["position_ids"], d, dim=1))
    assert torch.equal(out["tokens"], zigzag.permute(batch["tokens"], d, dim=1))
    # under TSP x CP, the same documents (whole sequence) on every CP rank
    if d == 2:
        for cp_rank in range(2):
            cp_out = zigzag.get_batch_on_this_tsp_rank(
                batch, 1, context_parallel_size=2, cp_rank=cp_rank
            )
            assert as_documents(cp_out["attention_mask"]) == documents


@pytest.mark.parametrize("d", [1, 2, 4])
def test_restarting_positions_without_document_mask_are_one_document(seed, d):
    """--reset-position-ids alone: one causal document whose learned positions restart (what
    TP+SP computes); the mask stays the permuted causal mask."""
    batch = _megatron_batch(seed, True, False)
    out = zigzag.get_batch_on_this_tsp_rank(batch, group_size=d)
    assert not isinstance(out["attention_mask"], DocumentMaskTensor)
    assert torch.equal(out["position_ids"], zigzag.permute(batch["position_ids"], d, dim=1))


def test_position_message_names_the_numbers():
    batch = {"position_ids": torch.tensor([[0, 1, 2, 3], [0, 1, 3, 4]])}
    with pytest.raises(PackedBatchError) as info:
        zigzag.get_batch_on_this_tsp_rank(batch, group_size=2)
    assert "sample 1 holds 3 at index 2" in str(info.value)
    batch = {"position_ids": torch.tensor([[0, 1, 2, 3], [1, 2, 3, 4]])}
    with pytest.raises(PackedBatchError, match="sample 1 holds 1 at index 0"):
        zigzag.get_batch_on_this_tsp_rank(batch, group_size=2)
    # restarting where a document starts is accepted; one id off is not
    mask = torch.ones(2, 1, 4, 4, dtype=torch.bool)
    for i, j in ((0, 0), (1, 0), (1, 1), (2, 2), (3, 2), (3, 3)):
        mask[:, 0, i, j] = False
    batch["attention_mask"] = mask
    batch["position_ids"] = torch.tensor([[0, 1, 0, 1], [0, 1, 0, 1]])
    zigzag.get_batch_on_this_tsp_rank(batch, group_size=2)
    batch["position_ids"] = torch.tensor([[0, 1, 0, 1], [0, 1, 2, 1]])
    with pytest.raises(PackedBatchError, match="sample 1 holds 1 at index 3"):
        zigzag.get_batch_on_this_tsp_rank(batch, group_size=2)


def test_malformed_mask_is_refused_naming_the_row():
    s = 8
    mask = torch.triu(torch.ones(s, s, dtype=torch.bool), 1).expand(2, 1, s, s).clone()
    mask[1, 0, 5, 6] = False  # a future key
    with pytest.raises(PackedBatchError, match="sample 1 the query at row 5 "):
        zigzag.get_batch_on_this_tsp_rank({"attention_mask": mask}, group_size=2)


@pytest.mark.parametrize(
    "reset_position_ids, reset_attention_mask, key, flag",
    [
        (True, True, "position_ids", "--reset-position-ids"),
        (True, False, "position_ids", "--reset-position-ids"),
        (False, True, "attention_mask", "--reset-attention-mask"),
    ],
)
def test_single_document_check_still_refuses_documents(
    seed, reset_position_ids, reset_attention_mask, key, flag
):
    """``check_single_causal_document`` (the Megatron-LM hook's check of a CP rank's slice)."""
    batch = _megatron_batch(seed, reset_position_ids, reset_attention_mask)
    with pytest.raises(PackedBatchError) as info:
        batch_contract.check_single_causal_document(batch)
    message = str(info.value)
    assert key in message and flag in message, (seed, message)


def test_mask_with_one_wrong_entry_is_refused_in_any_row_block(seed, monkeypatch):
    # row blocks of 3 rows: a defect in the last row of the last block is still found
    monkeypatch.setattr(batch_contract, "_MASK_BLOCK_ELEMENTS", 3 * 16)
    g = torch.Generator().manual_seed(seed)
    s = 16
    for _ in range(8):
        mask = torch.triu(torch.ones(s, s, dtype=torch.bool), 1).expand(2, 1, s, s).clone()
        b, i = int(torch.randint(2, (1,), generator=g)), int(torch.randint(s, (1,), generator=g))
        j = int(torch.randint(s, (1,), generator=g))
        mask[b, 0, i, j] = ~mask[b, 0, i, j]
        with pytest.raises(PackedBatchError) as info:
            batch_contract.check_single_causal_document({"attention_mask": mask})
        assert f"mask {b} the query at position {i} " in str(info.value), (seed, b, i, j)
    # a float mask with Megatron's convention (non-zero = masked) is read the same way
    causal = torch.triu(torch.ones(s, s), 1).view(1, 1, s, s)
    batch_contract.check_single_causal_document({"attention_mask": causal})
    with pytest.raises(PackedBatchError):
        batch_contract.check_single_causal_document({"attention_mask": 1.0 - causal})


def test_cu_seqlens_become_documents():
    batch = _megatron_batch(1, False, False, b=1)
    batch["attention_mask"] = None  # a THD batch carries no dense mask
    batch["cu_seqlens"] = torch.tensor([0, 10, 32], dtype=torch.int32)
    out = zigzag.get_batch_on_this_tsp_rank(batch, group_size=2)
    assert as_documents(out["attention_mask"]).starts == ((0, 10),)
    batch = _megatron_batch(1, False, False, b=2)
    batch["cu_seqlens"] = torch.tensor([0, 10, 32], dtype=torch.int32)
    with pytest.raises(PackedBatchError, match="cu_seqlens .* with 2 samples"):
        zigzag.get_batch_on_this_tsp_rank(batch, group_size=2)
    batch = _megatron_batch(1, False, True, b=1)  # a mask with other documents than cu_seqlens
    batch["cu_seqlens"] = torch.tensor([0, 10, 32], dtype=torch.int32)
    with pytest.raises(PackedBatchError, match="cu_seqlens documents"):
        zigzag.get_batch_on_this_tsp_rank(batch, group_size=2)


@pytest.mark.parametrize("c", [1, 2, 4])
def test_cp_positions_are_megatrons_cp_split(c):
    # Megatron's CP split of the whole sequence, written out: CP chunks r and 2C-1-r of 2C
    s = 48
    chunk = s // (2 * c)
    for r in range(c):
        want = list(range(r * chunk, (r + 1) * chunk))
        want += list(range((2 * c - 1 - r) * chunk, (2 * c - r) * chunk))
        assert natural_positions(s // c, c, r).tolist() == want
        # that rank's slice of a causal mask (rows = its queries, columns = every key) passes
        mask = torch.triu(torch.ones(s, s, dtype=torch.bool), 1)[want].view(1, 1, len(want), s)
        batch_contract.check_single_causal_document(
            {"position_ids": torch.tensor([want]), "attention_mask": mask}, c, r
        )
        if c > 1:
            with pytest.raises(PackedBatchError):
                batch_contract.check_single_causal_document(
                    {"position_ids": torch.arange(s // c).view(1, -1)}, c, r
                )
