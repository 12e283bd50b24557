"""Packed documents under TSP (issue 34): a block-diagonal causal ``attention_mask`` (Megatron's
``--reset-attention-mask``, True = masked) with position ids that restart per document, or a
THD batch's ``packed_seq_params``, computed exactly.

References are stock megatron-core: the single-process ``GPTModel`` (TP=1, local spec) and
Megatron TP=D+SP, both given the same dense document mask, which their local
``DotProductAttention`` applies. TSP gets the batch through ``get_batch_on_this_tsp_rank``
(the mask becomes a ``DocumentMaskTensor``). fp64: loss and every gradient, ``rtol=1e-10``.

Single process: the segment plan (every (query, key) pair the kernel calls cover is an
in-document causal pair, each once), the kernels' document forward/backward against dense
masked attention, the mask parser and its errors. The check functions below also run inside the
rank pool (``pool.run`` imports this module in every rank).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_tsp.core import sharding, zigzag
from megatron_tsp.core.documents import (
    DocumentMask,
    DocumentMaskTensor,
    PackedBatchError,
    as_documents,
)
from megatron_tsp.core.layers import kernels
from megatron_tsp.core.layout import TSPLayout
from tests.common import DTYPES, TOL, assert_close

# ---------------------------------------------------------------------------------------------
# documents used by the tests


def random_starts(seed: int, batch: int, seq: int, most: int = 6):
    """Per sample 2..``most`` documents cut at random positions (lengths from 1 token up)."""
    g = torch.Generator().manual_seed(seed + 11)
    rows = []
    for _ in range(batch):
        n = int(torch.randint(1, most, (1,), generator=g))
        cuts = sorted((torch.randperm(seq - 1, generator=g)[:n] + 1).tolist())
        rows.append([0] + cuts)
    return rows


CASES = {
    # many documents shorter than a chunk (D=4, S=32: chunks of 4), single-token ones included
    "short": lambda seed, b, s: [
        [0, 1, 3, 4, 6, 7, 13, 14, 20, 27, 30][: max(2, s // 3)],
        [0, 2, 5, 9, 10, 11, 16, 24, 31],
    ][:b],
    # documents spanning many chunks, boundaries off the chunk grid
    "long": lambda seed, b, s: [[0, 23], [0, 5]][:b],
    "random": lambda seed, b, s: random_starts(seed, b, s),
}


def document_mask(case: str, seed: int, batch: int, seq: int) -> DocumentMask:
    starts = CASES[case](seed, batch, seq)
    starts = [[p for p in row if p < seq] for row in starts]
    return DocumentMask.from_document_starts(starts, seq)


def _dense_reference(q, k, v, mask, scale):
    """Masked softmax attention, [b, h, s, d] / [b, g, s, d], mask [b, 1, s, s] True = masked."""
    groups = k.shape[1]
    k = k.repeat_interleave(q.shape[1] // groups, dim=1)
    v = v.repeat_interleave(q.shape[1] // groups, dim=1)
    scores = (q @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


# ---------------------------------------------------------------------------------------------
# single process


def test_mask_round_trip_and_errors(seed):
    for case in CASES:
        dm = document_mask(case, seed, 2, 32)
        assert DocumentMask.from_attention_mask(dm.dense_mask()) == dm, (case, seed)
        assert as_documents(dm.to_tensor()) == dm
        assert as_documents(dm.to_tensor().detach()) == dm  # what recomputation hands back
        assert as_documents(torch.zeros(2, 1, 4, 4, dtype=torch.bool)) is None
    # float mask, Megatron's convention (non-zero = masked)
    dm = document_mask("random", seed, 2, 32)
    assert DocumentMask.from_attention_mask(dm.dense_mask().float()) == dm
    # one entry changed so that no document mask has that row: a future key unmasked, a key
    # before the document (not adjacent to it) unmasked, a key inside the document masked.
    # The row is named.
    g = torch.Generator().manual_seed(seed)
    flips = 0
    while flips < 8:
        b, i = int(torch.randint(2, (1,), generator=g)), int(torch.randint(32, (1,), generator=g))
        j = int(torch.randint(32, (1,), generator=g))
        start = max(p for p in dm.starts_of(b) if p <= i)
        if not (j > i or j < start - 1 or start < j < i):
            continue
        mask = dm.dense_mask().clone()
        mask[b, 0, i, j] = ~mask[b, 0, i, j]
        with pytest.raises(PackedBatchError, match=f"sample {b} the query at row {i} "):
            DocumentMask.from_attention_mask(mask)
        flips += 1
    with pytest.raises(PackedBatchError, match="cu_seqlens ends at 30"):
        DocumentMask.from_cu_seqlens(torch.tensor([0, 10, 30]), 32)
    with pytest.raises(PackedBatchError, match="entry 2"):
        DocumentMask.from_cu_seqlens([0, 10, 10, 32], 32)
    with pytest.raises(PackedBatchError, match="per-head"):
        DocumentMask.from_attention_mask(torch.zeros(1, 2, 4, 4, dtype=torch.bool))


@pytest.mark.parametrize("d", [1, 2, 4])
@pytest.mark.parametrize("c", [1, 2])
@pytest.mark.parametrize("case", sorted(CASES))
def test_segments_visit_exactly_the_document_pairs(seed, d, c, case):
    """The (query, key) pairs the kernel calls cover, over every rank of the sequence group,
    are each in-document causal pair exactly once (counted through a recording kernel that runs
    ``kernels.document_forward``); and the pair count equals the sum over documents of their
    causal pairs."""
    seq, batch = 48 * c, 2
    seq = seq - seq % (2 * d * c)
    dm = document_mask(case, seed, batch, seq)
    visited = torch.zeros(batch, seq, seq, dtype=torch.long)
    calls = []

    class Recording(kernels.CpuFlashKernel):
        def forward(self, q, k, v, alignment, scale):
            calls.append((q.shape, k.shape, alignment))
            return super().forward(q, k, v, alignment, scale)

    for rank in range(d * c):
        layout = TSPLayout(d * c, seq, rank, context_parallel_size=c)
        positions = layout.positions().tolist()
        plans = dm.segments(layout.natural_runs, batch)
        for plan in plans:
            for seg in plan.blocks:
                for i in range(seg.query_len):
                    p = positions[seg.query_start + i]
                    first = seg.key_start
                    last = seg.key_start + seg.key_len - seg.query_len + i  # bottom-right
                    assert last == p, (rank, seg, i, p)
                    rows = slice(plan.sample_start, plan.sample_start + plan.sample_count)
                    visited[rows, p, first : last + 1] += 1
        q = torch.randn(layout.local_len, batch, 2, 4, dtype=torch.float64)
        kv = torch.randn(seq, batch, 1, 4, dtype=torch.float64)
        calls.clear()
        kernels.document_forward(Recording(), q, kv, kv, plans, 0.5, layout.gathered_blocks)
        n_segments = sum(len(plan.blocks) for plan in plans)
        assert len(calls) == n_segments and all(a == kernels.BOTTOM_RIGHT for *_, a in calls)
    want = ~dm.dense_mask().squeeze(1)
    assert torch.equal(visited, want.long()), (case, seed)
    assert int(visited.sum()) == dm.pairs() * (batch // len(dm.starts))


@pytest.mark.parametrize("d", [1, 2, 4])
@pytest.mark.parametrize("case", sorted(CASES))
def test_document_kernels_match_dense_masked_attention(seed, d, case):
    """``document_forward`` / ``document_backward`` on each rank's rows and the natural K/V
    equal dense masked attention (output, dq, and dK/dV summed over the ranks), fp64,
    GQA (4 query heads, 2 K/V heads), cpu_flash (top-left: prefix + diagonal merged)."""
    seq, batch, scale = 32, 2, 0.3
    dm = document_mask(case, seed, batch, seq)
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, 4, seq, 8, dtype=torch.float64, generator=g, requires_grad=True)
    k = torch.randn(batch, 2, seq, 8, dtype=torch.float64, generator=g, requires_grad=True)
    v = torch.randn(batch, 2, seq, 8, dtype=torch.float64, generator=g, requires_grad=True)
    d_out = torch.randn(batch, 4, seq, 8, dtype=torch.float64, generator=g)
    ref = _dense_reference(q, k, v, dm.dense_mask(), scale)
    ref_dq, ref_dk, ref_dv = torch.autograd.grad(ref, (q, k, v), d_out)
    kernel = kernels.CpuFlashKernel()
    # [s, b, n, d] layouts, as the layer holds them
    q_s, k_s, v_s, g_s = (t.detach().permute(2, 0, 1, 3) for t in (q, k, v, d_out))
    dkv = torch.zeros(seq, batch, 4, 8, dtype=torch.float64)
    for rank in range(d):
        layout = TSPLayout(d, seq, rank)
        pos = layout.positions()
        plans = dm.segments(layout.natural_runs, batch)
        blocks = layout.gathered_blocks
        q_r = q_s.index_select(0, pos)
        outs, lses = kernels.document_forward(kernel, q_r, k_s, v_s, plans, scale, blocks)
        out = torch.cat(outs, 0).view(-1, batch, 4, 8)
        torch.testing.assert_close(
            out, ref.detach().permute(2, 0, 1, 3)[pos], rtol=1e-11, atol=1e-13
        )
        d_ctx = g_s.index_select(0, pos).reshape(-1, batch, 32)
        dq, dkv_r = kernels.document_backward(
            kernel, d_ctx, q_r, k_s, v_s, plans, scale, outs, lses, blocks
        )
        torch.testing.assert_close(dq, ref_dq.permute(2, 0, 1, 3)[pos], rtol=1e-11, atol=1e-13)
        dkv += dkv_r
    torch.testing.assert_close(dkv[:, :, :2], ref_dk.permute(2, 0, 1, 3), rtol=1e-11, atol=1e-13)
    torch.testing.assert_close(dkv[:, :, 2:], ref_dv.permute(2, 0, 1, 3), rtol=1e-11, atol=1e-13)


# ---------------------------------------------------------------------------------------------
# checks run inside every rank of the pool


def _doc_batch(seed, batch, seq, vocab, dm: DocumentMask, reset_positions: bool, mask=True):
    """``checks_gpt._batch`` with ``dm``'s dense mask (``mask``; else the causal mask) and,
    with ``reset_positions``, position ids restarting at ``dm``'s documents."""
    from tests import checks_gpt

    data = checks_gpt._batch(seed, batch, seq, vocab)
    masks = dm if mask else DocumentMask.from_document_starts([[0]], seq)
    data["attention_mask"] = masks.dense_mask().expand(batch, 1, seq, seq).contiguous()
    if reset_positions:
        data["position_ids"] = dm.position_ids().expand(batch, seq).contiguous()
    return data


def _config(d, dtype, style, groups, recompute=None, cp=1):
    from tests import checks_gpt

    config = checks_gpt._config(d, dtype, style, 2, 32, 8, 64, groups)
    if recompute == "selective":
        config = dataclasses.replace(config, recompute_granularity="selective")
    elif recompute == "full":
        config = dataclasses.replace(
            config, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
        )
    if cp > 1:
        config = dataclasses.replace(config, context_parallel_size=cp)
    return config


def _gpt(config, spec, style, vocab, seq, rotary_base=None):
    """``checks_gpt._model`` (untied, full logits) with an optional RoPE base."""
    from megatron.core.models.gpt import GPTModel

    from tests.checks_gpt import STYLES

    return GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=vocab,
        max_sequence_length=seq,
        parallel_output=False,
        position_embedding_type=STYLES[style]["position_embedding_type"],
        share_embeddings_and_output_weights=False,
        **({} if rotary_base is None else {"rotary_base": rotary_base}),
    )


def _positions_to(model, dtype):
    """Learned absolute position embeddings in ``dtype``: megatron-core keeps them in fp32
    whatever ``params_dtype`` is, and with position ids restarting per document their gradient
    sums many tokens per row in fp32, in an order that differs between any two layouts (1e-7
    apart). In fp64 the parity is exact (both sides get the same cast)."""
    embedding = getattr(model, "embedding", None)
    table = getattr(embedding, "position_embeddings", None)
    if table is not None:
        table.to(dtype)
    return model


def _forward_loss(model, local, data, packed_seq_params=None):
    """Exact loss path (vocab-gathered logits, fp64 cross-entropy); the loss normalised by the
    whole batch's mask count (a CP rank's part, summed over CP by the caller)."""
    kwargs = {} if packed_seq_params is None else {"packed_seq_params": packed_seq_params}
    logits = model(local["tokens"], local["position_ids"], local["attention_mask"], **kwargs)
    losses = -torch.log_softmax(logits, -1).gather(-1, local["labels"].unsqueeze(-1)).squeeze(-1)
    part = (losses * local["loss_mask"].to(losses.dtype)).sum() / data["loss_mask"].sum()
    part.backward()
    return part.detach().clone()


def check_gpt_documents(
    d,
    seed,
    style,
    case="random",
    baseline="single",
    groups=None,
    cp=1,
    recompute=None,
    reset_positions=True,
    thd=False,
    batch=2,
    seq=32,
    vocab=128,
    dtype_name="float64",
    rtol=1e-10,
    rotary_base=None,
    mask_documents=True,
):
    """A TSP GPTModel (D=``d``, ``cp`` CP ranks) on a packed batch vs stock megatron-core given
    the dense document mask: ``baseline`` "single" (TP=1) or "tp_sp" (TP=D+SP on the same
    ranks, its state dict loaded into TSP): loss and every gradient. ``thd``: the TSP model is
    called with megatron-core's ``PackedSeqParams`` (qkv_format 'thd', b=1, ``max_seqlen`` the
    longest document, so the rotary table is that short) and no mask; TSP then rotates each
    token at its position within its document as Megatron's THD RoPE does, the reference at its
    sequence position (the same scores: RoPE is relative). ``rotary_base``: GPTModel's.
    ``recompute``: "selective" (TSP's attention_backward "recompute") or "full" (Megatron's
    checkpointed layers: the ``DocumentMaskTensor`` goes through ``save_for_backward``)."""
    import torch.distributed as dist
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_tsp.core.specs import get_gpt_block_tsp_spec
    from tests import checks_gpt
    from tests.common import (
        group_info,
        reference_single_layer_spec,
        reference_tp_sp_block_spec,
        setup_megatron_tp,
        setup_tsp,
    )

    dtype = DTYPES[dtype_name]
    dm = document_mask(case, seed, 1 if thd else batch, seq)
    if thd:
        batch = 1
    data = _doc_batch(seed, batch, seq, vocab, dm, reset_positions, mask_documents)
    if not mask_documents:  # --reset-position-ids alone: one causal document
        dm = DocumentMask.from_document_starts([[0]], seq)
    ref_d = 1 if baseline == "single" else d
    setup_megatron_tp(ref_d, seed)
    ref_config = _config(ref_d, dtype, style, groups)
    spec = reference_single_layer_spec if baseline == "single" else reference_tp_sp_block_spec
    ref = _positions_to(_gpt(ref_config, spec(ref_config), style, vocab, seq, rotary_base), dtype)
    if baseline == "single":
        checks_gpt._norms_to(ref, dtype)
    ref_state = {k: v.clone() if torch.is_tensor(v) else v for k, v in ref.state_dict().items()}
    ref_params = {n: p.detach().clone() for n, p in ref.named_parameters()}
    ref_loss = _forward_loss(ref, data, data)
    if baseline == "tp_sp":
        tp_group = checks_gpt._tp_group_info()[0]
        sharding.allreduce_sequence_parallel_grads(ref, tp_group)
    ref_grads = {n: p.grad.clone() for n, p in ref.named_parameters()}

    if cp > 1:
        from tests.checks_tsp_cp import _sum_over_cp, setup_tsp_cp

        groups_cp = setup_tsp_cp(d, cp, seed)
        group, cp_rank = groups_cp["tp"], groups_cp["cp_rank"]
    else:
        setup_tsp(d, seed)
        group, cp_rank = group_info()[0], 0
    config = _config(d, dtype, style, groups, recompute, cp)
    model = _gpt(config, get_gpt_block_tsp_spec(config), style, vocab, seq, rotary_base)
    _positions_to(model, dtype)
    if baseline == "single":
        sharding.load_full_state(model, ref_params, group)
    else:
        model.load_state_dict(ref_state, strict=True)
    local = zigzag.get_batch_on_this_tsp_rank(data, d, context_parallel_size=cp, cp_rank=cp_rank)
    packed = None
    if dm.is_single_document:
        assert not isinstance(local["attention_mask"], DocumentMaskTensor)
    else:
        assert isinstance(local["attention_mask"], DocumentMaskTensor), type(
            local["attention_mask"]
        )
        assert as_documents(local["attention_mask"]) == dm
    if thd:
        cu = torch.tensor(list(dm.starts[0]) + [seq], dtype=torch.int32)
        longest = max(dm.document_lengths(0))
        packed = PackedSeqParams(
            qkv_format="thd",
            cu_seqlens_q=cu,
            cu_seqlens_kv=cu,
            max_seqlen_q=longest,
            max_seqlen_kv=longest,
        )
        local = dict(local, attention_mask=None)
    loss = _forward_loss(model, local, data, packed)
    if cp > 1:
        dist.all_reduce(loss, group=groups_cp["cp"])
        _sum_over_cp(model, groups_cp["cp"])
    sharding.allreduce_sequence_parallel_grads(model, group)
    if baseline == "single":
        grads = sharding.gather_full_state(model, group, grads=True)
    else:
        grads = {n: p.grad for n, p in model.named_parameters()}
    actual = {"loss": loss, **{f"grad:{n}": t for n, t in grads.items()}}
    expected = {"loss": ref_loss, **{f"grad:{n}": t for n, t in ref_grads.items()}}
    return assert_close(
        actual,
        expected,
        rtol=rtol if rtol is not None else TOL[dtype],
        what=f"TSP documents ({case}: {dm.starts}) GPT ({style}, D={d}, C={cp}, groups="
        f"{config.num_query_groups}, recompute={recompute}, thd={thd}) vs {baseline}, "
        f"seed={seed}",
    )


def check_single_document_is_the_causal_path(d, seed, style, backward="saved"):
    """A one-document ``DocumentMask`` per sample, given as ``attention_mask``, leaves TSP's
    output and every gradient bit for bit equal to no mask at all (today's causal path)."""
    from megatron_tsp.core.specs import get_gpt_block_tsp_spec
    from tests import checks_gpt
    from tests.common import group_info, setup_tsp

    seq, vocab = 32, 128
    data = checks_gpt._batch(seed, 2, seq, vocab)
    setup_tsp(d, seed)
    group, size, _ = group_info()
    config = _config(
        d, torch.float64, style, None, "selective" if backward == "recompute" else None
    )
    results = []
    for mask in (None, DocumentMask.from_document_starts([[0], [0]], seq).to_tensor()):
        setup_tsp(d, seed)
        model = checks_gpt._model(config, get_gpt_block_tsp_spec(config), style, vocab, seq, False)
        local = zigzag.get_batch_on_this_tsp_rank(data, size)
        local["attention_mask"] = mask
        logits = model(local["tokens"], local["position_ids"], local["attention_mask"])
        logits.pow(2).mean().backward()
        results.append(
            (logits.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None])
        )
    (a, ga), (b, gb) = results
    assert torch.equal(a, b)
    assert len(ga) == len(gb) and all(torch.equal(x, y) for x, y in zip(ga, gb))
    return True


# ---------------------------------------------------------------------------------------------
# pool tests


@pytest.mark.parametrize("style", ["gpt2", "llama"])
@pytest.mark.parametrize("d", [2, 4])
@pytest.mark.parametrize("case", ["short", "long", "random"])
def test_gpt_documents_vs_single_fp64(pool4, seed, d, style, case):
    pool4.run(check_gpt_documents, d, seed, style, case)


@pytest.mark.parametrize("style", ["gpt2", "llama"])
@pytest.mark.parametrize("d", [2, 4])
def test_gpt_documents_vs_tp_sp_fp64(pool4, seed, d, style):
    pool4.run(check_gpt_documents, d, seed, style, "random", baseline="tp_sp")


@pytest.mark.parametrize("d,groups", [(4, 2), (4, 1), (2, 1)])
def test_gpt_documents_gqa_fewer_kv_heads_fp64(pool4, seed, d, groups):
    """GQA, including fewer K/V heads than D (head groups of several shards)."""
    pool4.run(check_gpt_documents, d, seed, "llama", "short", groups=groups)


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_gpt_documents_recompute_fp64(pool4, seed, recompute):
    """TSP's attention_backward "recompute" (selective core_attn) and Megatron's full layer
    recomputation (the mask goes through ``tensor_parallel.checkpoint``)."""
    pool4.run(check_gpt_documents, 4, seed, "llama", "random", recompute=recompute)


def test_gpt_restarted_positions_one_document_fp64(pool4, seed):
    """--reset-position-ids alone: the causal mask with learned positions restarting (one
    causal document per sample, as TP+SP computes it)."""
    pool4.run(check_gpt_documents, 2, seed, "gpt2", "random", mask_documents=False)


def test_gpt_documents_gpt2_positions_not_reset_fp64(pool4, seed):
    """--reset-attention-mask without --reset-position-ids: natural positions, documents."""
    pool4.run(check_gpt_documents, 2, seed, "gpt2", "random", reset_positions=False)


@pytest.mark.parametrize("style", ["gpt2", "llama"])
def test_gpt_documents_tsp_x_cp_fp64(pool4, seed, style):
    """TSP x CP (D, C) = (2, 2): K/V of the 4 sequence ranks, documents over the whole
    sequence."""
    pool4.run(check_gpt_documents, 2, seed, style, "random", cp=2, seq=48)


@pytest.mark.parametrize("d", [2, 4])
def test_gpt_packed_seq_params_thd_fp64(pool4, seed, d):
    """megatron-core's API: ``packed_seq_params`` (qkv_format 'thd', b=1) instead of a mask."""
    # rotary base 16 with head dim 4: inverse frequencies 1 and 1/4, so the fp32 angles are
    # exact at restarted and at sequence positions; megatron-core rounds their cos / sin to
    # fp32 before the cast, so rotations at the two positions agree to ~1e-9, not to fp64
    # (a missed document start is off by 1e-2)
    pool4.run(check_gpt_documents, d, seed, "llama", "random", thd=True, rotary_base=16, rtol=1e-8)


@pytest.mark.parametrize("backward", ["saved", "recompute"])
def test_single_document_bit_for_bit(pool4, seed, backward):
    pool4.run(check_single_document_is_the_causal_path, 4, seed, "llama", backward)


def check_refusals(d, seed):
    """Inference prefill and attention dropout with documents are refused by name; a
    DocumentMask over another sequence length, and THD with b > 1, too."""
    from megatron.core.packed_seq_params import PackedSeqParams

    from megatron_tsp.core.specs import get_gpt_block_tsp_spec
    from tests import checks_gpt
    from tests.common import setup_tsp

    seq = 32
    setup_tsp(d, seed)
    config = _config(d, torch.float64, "llama", None)
    model = checks_gpt._model(config, get_gpt_block_tsp_spec(config), "llama", 128, seq, False)
    attention = model.decoder.layers[0].self_attention
    x = torch.randn(seq // d, 2, config.hidden_size, dtype=torch.float64)
    docs = DocumentMask.from_document_starts([[0, 5], [0, 9, 20]], seq)
    with pytest.raises(ValueError, match="inference prefill does not support packed documents"):
        attention(x, attention_mask=docs.to_tensor(), inference_context=object())
    with pytest.raises(PackedBatchError, match="documents over 48 positions"):
        attention(x, attention_mask=DocumentMask.from_document_starts([[0, 5]], 48).to_tensor())
    cu = torch.tensor([0, 5, seq], dtype=torch.int32)
    thd = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    with pytest.raises(ValueError, match="micro-batch size 1, got 2"):
        attention(x, packed_seq_params=thd)
    with pytest.raises(ValueError, match="qkv_format='thd' only, got 'sbhd'"):
        attention(x[:, :1], packed_seq_params=PackedSeqParams(qkv_format="sbhd"))
    attention.head_layout = dataclasses.replace(attention.head_layout, dropout_p=0.1)
    with pytest.raises(ValueError, match="--attention-dropout=0.1"):
        attention(x, attention_mask=docs.to_tensor())
    return True


def test_refusals(pool4, seed):
    pool4.run(check_refusals, 2, seed)


def bf16_documents_errors(d, seed, style):
    """``checks_precision.bf16_errors_vs_fp64`` (fp64 single-process reference, bf16 Megatron
    TP=D+SP and bf16 TSP-D from the same bf16-rounded weights) on a packed batch: random
    documents, the dense mask for the reference and TP+SP, restarting position ids."""
    from tests import checks_precision

    original = checks_precision._batch

    def packed(seed_, batch, seq, vocab):
        return _doc_batch(
            seed_, batch, seq, vocab, document_mask("random", seed_, batch, seq), True
        )

    checks_precision._batch = packed
    try:
        return checks_precision.bf16_errors_vs_fp64(d, seed, style, kinds=("tp_sp", "tsp"))
    finally:
        checks_precision._batch = original


BF16_SEEDS = 8


@pytest.mark.parametrize("style", ["llama", "gpt2"])
def test_gpt_documents_bf16_no_less_accurate_than_tp_sp(pool4, seed, style):
    """bf16 with packed documents, by the whole-model criterion of
    ``tests/test_precision.py::test_gpt_bf16_no_less_accurate_than_tp_sp`` (hidden states no
    less accurate than TP+SP's, per-token loss, gradients' geometric mean and weight-gradient
    families within its bounds), D=4, ``BF16_SEEDS`` seeds from ``seed``."""
    from tests.test_precision import D, _report_and_check_gpt

    runs = [pool4.run(bf16_documents_errors, D, seed + i, style)[0] for i in range(BF16_SEEDS)]
    _report_and_check_gpt(runs, seed, style)
