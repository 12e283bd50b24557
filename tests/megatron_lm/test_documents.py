"""Megatron-LM's packed documents read from a batch without an S x S mask
(``megatron_tsp.megatron_lm.documents``) equal the documents of Megatron's own dense mask.

The reference is megatron-core's ``_get_ltor_masks_and_position_ids`` (the GPT dataset's rule,
installed megatron-core: the same function in core_v0.16.1 and core_v0.19.0) on random tokens
with EODs inside the sequences, at the sequence's ends, back to back and absent: its dense
``--reset-attention-mask`` mask, read by ``DocumentMask.from_attention_mask``, must give the same
starts as the EOD rule on the tokens and as the position-id rule on its
``--reset-position-ids`` positions. Single process, no Megatron-LM tree; seconds.
"""

import pytest
import torch

from megatron_tsp.core.documents import DocumentMask, PackedBatchError
from megatron_tsp.megatron_lm import documents as D

EOD = 7


def _ltor(tokens, reset_position_ids, reset_attention_mask, create_attention_mask=True):
    from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids

    return _get_ltor_masks_and_position_ids(
        tokens, EOD, reset_position_ids, reset_attention_mask, False, create_attention_mask
    )


def _sample(g, s, eods):
    tokens = torch.randint(0, 32, (s,), generator=g)
    tokens[tokens == EOD] = EOD + 1
    tokens[list(eods)] = EOD
    return tokens


def _megatron_batch(seed, b=3, s=48):
    """Megatron's per-sample tensors, stacked as the data loader collates them."""
    g = torch.Generator().manual_seed(seed)
    cases = [
        [5, 6, 20, s - 1],  # back to back, and one at the last index (starts nothing)
        [0, 31],  # the first token an EOD
        [],  # one document
    ]
    tokens, masks, positions = [], [], []
    for i in range(b):
        extra = torch.randint(0, s, (2,), generator=g).tolist()
        t = _sample(g, s, sorted(set(cases[i % len(cases)] + (extra if i >= 3 else []))))
        mask, _, pos = _ltor(t, True, True)
        tokens.append(t)
        masks.append(mask)
        positions.append(pos)
    return torch.stack(tokens), torch.stack(masks), torch.stack(positions)


@pytest.mark.parametrize("b", [1, 3, 5])
def test_every_rule_gives_megatrons_documents(seed, b):
    tokens, mask, positions = _megatron_batch(seed, b=b)
    reference = DocumentMask.from_attention_mask(mask)
    assert not reference.is_single_document
    from_eod = D.from_start_flags(D.starts_after_eod(tokens, EOD))
    from_positions = D.from_start_flags(D.starts_of_position_ids(positions))
    assert from_eod == reference and from_positions == reference
    # the documents' restarted positions are Megatron's --reset-position-ids
    assert torch.equal(reference.position_ids(), positions)
    # an EOD at the last index starts nothing; back-to-back EODs make a one-token document
    assert reference.starts[0] == (0, 6, 7, 21)


def test_documents_of_batch_picks_the_source(seed):
    tokens, mask, positions = _megatron_batch(seed)
    reference = DocumentMask.from_attention_mask(mask)
    natural = torch.arange(tokens.shape[1]).expand_as(tokens)
    rules = {
        "eod": D.DocumentRule(reset_attention_mask=True, eod=EOD),
        "positions": D.DocumentRule(
            reset_attention_mask=True, reset_position_ids=True, eod=lambda: -5
        ),
    }
    # no dataloader mask: EOD tokens (natural positions), or the position-id restarts (the EOD
    # id is then never asked: a wrong one changes nothing)
    batch = dict(tokens=tokens, position_ids=natural, attention_mask=None)
    assert D.documents_of_batch(batch, rules["eod"]) == reference
    assert rules["eod"].source(batch) == "the tokens after each EOD"
    batch = dict(tokens=tokens, position_ids=positions, attention_mask=None)
    assert D.documents_of_batch(batch, rules["positions"]) == reference
    assert "--reset-position-ids" in rules["positions"].source(batch)
    # the dataloader's mask, when it is there, is read (and validated) instead
    batch = dict(tokens=torch.zeros_like(tokens), position_ids=natural, attention_mask=mask)
    assert D.documents_of_batch(batch, rules["eod"]) == reference
    # --reset-position-ids alone, or no flag: one causal document per sequence
    for rule in (D.DocumentRule(reset_position_ids=True, eod=EOD), D.DocumentRule()):
        assert D.documents_of_batch(dict(batch, position_ids=positions), rule) is None
        assert rule.source(batch) is None


def test_the_eod_id_is_asked_once_needed():
    asked = []
    rule = D.DocumentRule(reset_attention_mask=True, eod=lambda: asked.append(1) or EOD)
    tokens = torch.tensor([[1, EOD, 2, 3]])
    documents = D.documents_of_batch(dict(tokens=tokens, attention_mask=None), rule)
    assert documents.starts == ((0, 2),) and asked == [1]
    with pytest.raises(PackedBatchError, match="no EOD id is known"):
        D.documents_of_batch(dict(tokens=tokens), D.DocumentRule(reset_attention_mask=True))


def test_bad_position_ids_are_refused_by_name():
    good = torch.tensor([[0, 1, 2, 0, 1, 0]])
    assert D.from_start_flags(D.starts_of_position_ids(good)).starts == ((0, 3, 5),)
    with pytest.raises(PackedBatchError) as err:
        D.starts_of_position_ids(torch.tensor([[0, 1, 2, 0, 2, 3], [0, 1, 2, 3, 4, 5]]))
    assert "--reset-position-ids" in str(err.value)
    assert "sample 0 hold 2 at index 4 where a document's positions continue to 1" in str(err.value)
    with pytest.raises(PackedBatchError, match="sample 1 hold 3 at index 0"):
        D.starts_of_position_ids(torch.tensor([[0, 1], [3, 4]]))


def test_later_pipeline_stage_batch_is_refused_by_name():
    rule = D.DocumentRule(reset_attention_mask=True, reset_position_ids=True, eod=EOD)
    with pytest.raises(PackedBatchError, match="no position_ids .*later pipeline stage"):
        D.documents_of_batch(dict(labels=torch.zeros(1, 4), position_ids=None), rule)


def test_long_sequence_reads_no_s_by_s(seed):
    """128k tokens, documents every ~1k: the starts come out of O(S) work (no [s, s] tensor:
    one would be 16 GiB as bool)."""
    s = 131072
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 32, (1, s), generator=g)
    tokens[tokens == EOD] = EOD + 1
    ends = torch.randperm(s, generator=g)[:128].sort().values
    tokens[0, ends] = EOD
    documents = D.from_start_flags(D.starts_after_eod(tokens, EOD))
    expected = (0,) + tuple(int(e) + 1 for e in ends if int(e) + 1 < s)
    assert documents.starts == (expected,) and documents.seq_length == s
    positions = documents.position_ids()
    assert D.from_start_flags(D.starts_of_position_ids(positions)) == documents
