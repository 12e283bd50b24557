"""Packed documents are refused, not silently merged: batches built the way Megatron-LM's
``--reset-attention-mask`` / ``--reset-position-ids`` build them (megatron-core's own
``_get_ltor_masks_and_position_ids`` on EOD-separated tokens) and THD batches with
``cu_seqlens`` raise ``PackedBatchError`` in ``get_batch_on_this_tsp_rank`` naming the key and
the flag; a single document (no EOD, or the flags off) passes and permutes as before. Single
process."""

import pytest
import torch
from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids

from megatron_tsp.core import batch_contract, zigzag
from megatron_tsp.core.batch_contract import PackedBatchError, natural_positions

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


@pytest.mark.parametrize(
    "reset_position_ids, reset_attention_mask, key, flag",
    [
        (True, True, "position_ids", "--reset-position-ids"),
        (True, False, "position_ids", "--reset-position-ids"),
        (False, True, "attention_mask", "--reset-attention-mask"),
    ],
)
@pytest.mark.parametrize("d", [1, 2, 4])
def test_document_batches_are_refused_by_name(
    seed, d, reset_position_ids, reset_attention_mask, key, flag
):
    batch = _megatron_batch(seed, reset_position_ids, reset_attention_mask)
    with pytest.raises(PackedBatchError) as info:
        zigzag.get_batch_on_this_tsp_rank(batch, group_size=d)
    message = str(info.value)
    assert key in message and flag in message, (seed, message)
    assert "one causal document" in message
    # the first offending sequence is named: sequence 0 has documents, so it is the one
    assert "sequence 0" in message or "mask 0" in message, message


def test_position_message_names_the_numbers():
    batch = {"position_ids": torch.tensor([[0, 1, 2, 3], [0, 1, 0, 1]])}
    with pytest.raises(PackedBatchError) as info:
        zigzag.get_batch_on_this_tsp_rank(batch, group_size=2)
    assert "sequence 1 holds 0 at index 2, expected 2" in str(info.value)


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


def test_cu_seqlens_refused():
    batch = _megatron_batch(1, False, False)
    batch["cu_seqlens"] = torch.tensor([0, 10, 32], dtype=torch.int32)
    with pytest.raises(PackedBatchError) as info:
        zigzag.get_batch_on_this_tsp_rank(batch, group_size=2)
    assert "cu_seqlens" in str(info.value) and "--sft" in str(info.value)


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
