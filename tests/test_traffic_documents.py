"""``megatron-tsp bench --traffic --documents``: TSP's packed-document attention path recorded.

* one tiny layer of TSP and of TP+SP recorded on shape-only CUDA tensors (the CUDA stand-in, a
  fresh interpreter) with two samples of different documents: TSP's attention FLOPs are the
  recorder's convention (2 heads (d_qk + d_v) per visited pair forward, 2 heads (3 d_qk +
  2 d_v) backward) over the in-document causal pairs of the recorded rank's queries, counted
  here position by position; its attention calls are one per (chunk, document) segment per
  head group and direction; TP+SP's are one variable-length call per direction over every
  token's in-document pairs for its 1/D of the heads;
* a mix of single documents records op for op what the layer records without documents;
* the variable-length stand-in computes in-document causal attention and its gradients
  (against a dense-masked fp64 reference), one recorded op per direction;
* a malformed mix and a scheme that does not record documents are refused naming the flag.
Counts are deterministic; nothing here is timed.
"""

from __future__ import annotations

import pytest
import torch

from megatron_tsp.core.layout import TSPLayout
from megatron_tsp.tools import traffic
from tests.test_traffic import HEADS, SEQ, D, H, _record_tiny_layer

HEAD_DIM = H // HEADS
# two samples, different documents: the plan has one group of segments per sample
DOCUMENTS = [[10, 30, 24], [5, 40, 19]]


def _record(tmp_path_factory, documents, micro_batch):
    return _record_tiny_layer(tmp_path_factory, D, micro_batch=micro_batch, documents=documents)


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    return _record(tmp_path_factory, DOCUMENTS, micro_batch=2)


@pytest.fixture(scope="module")
def plain_two_samples(tmp_path_factory):
    return _record(tmp_path_factory, None, micro_batch=2)


def _attention(summary, phase):
    return [
        r
        for r in summary["records"]
        if r["kind"] == "kernel" and r["flop_kind"] == "attention" and r["phase"] == phase
    ]


def _document_of(lengths, p):
    """(start, end) of the document holding natural position p."""
    start = 0
    for n in lengths:
        if p < start + n:
            return start, start + n
        start += n
    raise AssertionError(p)


def _rank0_pairs_and_segments(lengths):
    """Rank 0's in-document causal pairs (each query p sees p - start + 1 keys) and its
    (chunk, document) segments, position by position over the rank's spans."""
    pairs, segments = 0, set()
    for span, (a, e) in enumerate(TSPLayout(D, SEQ).spans_of(0)):
        for p in range(a, e):
            start, _ = _document_of(lengths, p)
            pairs += p - start + 1
            segments.add((span, start))
    return pairs, len(segments)


def _all_pairs(lengths):
    """Every query's in-document keys, over the whole sequence."""
    return sum(p - _document_of(lengths, p)[0] + 1 for p in range(SEQ))


def test_tsp_attention_flops_are_the_rank_in_document_pairs(packed):
    """Forward: 2·heads·(d + d) = 4·d·heads FLOPs per in-document pair of rank 0's queries, over
    all the heads (TSP's rank computes every head for its tokens); backward 2·heads·(3d + 2d) =
    10·d·heads per pair (saved outputs: no recomputed forward)."""
    pairs = sum(_rank0_pairs_and_segments(row)[0] for row in DOCUMENTS)
    tsp = packed["tsp"]
    assert sum(r["flops"] for r in _attention(tsp, "forward")) == 4 * HEAD_DIM * HEADS * pairs
    assert sum(r["flops"] for r in _attention(tsp, "backward")) == 10 * HEAD_DIM * HEADS * pairs
    assert tsp["documents"]["pairs"] == pairs
    # every rank's queries together have every in-document pair once
    total = sum(_all_pairs(row) for row in DOCUMENTS)
    assert sum(tsp["documents"]["pairs_per_rank"]) == total
    assert tsp["attention_flops"] == 14 * HEAD_DIM * HEADS * pairs


def test_tsp_attention_calls_are_the_segments(packed):
    """One bottom-right call per (chunk, document) segment of each sample, per head group
    (ng = 4 >= D = 2: D head groups), forward and backward alike."""
    segments = sum(_rank0_pairs_and_segments(row)[1] for row in DOCUMENTS)
    head_groups = D
    tsp = packed["tsp"]
    for phase in ("forward", "backward"):
        calls = _attention(tsp, phase)
        assert len(calls) == segments * head_groups, [r["attention"] for r in calls]
        assert all(r["attention"]["bottom_right"] for r in calls)
        assert tsp["documents"]["calls"][phase] == len(calls)
    assert tsp["documents"]["segments"] == segments
    # the natural-order K/V copy: one index_select for K and one for V per head group, each
    # direction; each reads and writes the whole gathered sequence of the group's K/V heads
    copies = [r for r in tsp["records"] if r["source"] == traffic.NATURAL_KV_SOURCE]
    assert [r["name"] for r in copies] == ["index_select"] * 4 * head_groups
    kv_bytes = SEQ * 2 * (HEADS // head_groups) * HEAD_DIM * 2  # [S, b, ng/D, d] bf16
    assert all(r["written"] == kv_bytes and r["kind"] == "kernel" for r in copies)
    copied = tsp["documents"]["natural_kv_copy"]
    assert (
        copied["forward"]
        == copied["backward"]
        == sum(r["read"] + r["written"] for r in copies) // 2
    )


def test_tpsp_one_varlen_call_per_direction(packed, plain_two_samples):
    """TP+SP: one variable-length call each way over every token's in-document pairs for its
    HEADS / D heads; no other attention kernel."""
    pairs = sum(_all_pairs(row) for row in DOCUMENTS)
    tp_sp, tp_sp_plain = packed["tp_sp"], plain_two_samples["tp_sp"]
    fwd, bwd = _attention(tp_sp, "forward"), _attention(tp_sp, "backward")
    assert [r["name"] for r in fwd + bwd] == ["varlen_flash", "varlen_flash_backward"]
    # the rest of the layer: the kernels of the whole-sequence recording, no zeros for the
    # log-sum-exp's (absent) gradient
    assert tp_sp["kernels"] == tp_sp_plain["kernels"]
    heads = HEADS // D
    assert fwd[0]["flops"] == 4 * HEAD_DIM * heads * pairs
    assert bwd[0]["flops"] == 10 * HEAD_DIM * heads * pairs
    assert tp_sp["documents"]["pairs"] == pairs
    # forward reads q, k, v [S, b, heads, d] bf16 and writes the output and the fp32 lse
    qkv = 2 * SEQ * heads * HEAD_DIM * 2
    assert (fwd[0]["read"], fwd[0]["written"]) == (3 * qkv, qkv + 2 * SEQ * heads * 4)


def test_single_document_mix_records_what_no_documents_records(tmp_path_factory):
    """Every sample one document (``--documents single``): op for op the recording without
    ``--documents`` (TSP gets no document mask, TP+SP keeps its whole-sequence kernel)."""
    single = _record(tmp_path_factory, [[SEQ]], micro_batch=1)
    plain = _record(tmp_path_factory, None, micro_batch=1)

    def ops(summary):
        keys = ("name", "phase", "kind", "read", "written", "flops", "source")
        return [tuple(r[k] for k in keys) for r in summary["records"]]

    for scheme in ("tsp", "tp_sp"):
        assert ops(single[scheme]) == ops(plain[scheme]), scheme
        assert single[scheme]["bytes"] == plain[scheme]["bytes"]
        assert single[scheme]["documents"]["documents"] == 1
    assert single["tsp"]["documents"]["natural_kv_copy"] == {"forward": 0, "backward": 0}


def test_varlen_standin_is_in_document_attention():
    """The stand-in on real tensors: output and q/k/v gradients of in-document causal attention
    (GQA: 4 query heads on 2 K/V heads) against a dense-masked fp64 SDPA; two samples packed as
    one THD sequence; one recorded op per direction."""
    torch.manual_seed(0)
    s, b, n, g, d = 12, 2, 4, 2, 8
    lengths = [[5, 7], [12]]
    q = torch.randn(s, b, n, d, dtype=torch.float64, requires_grad=True)
    k = torch.randn(s, b, g, d, dtype=torch.float64, requires_grad=True)
    v = torch.randn(s, b, g, d, dtype=torch.float64, requires_grad=True)
    grad = torch.randn(s, b, n, d, dtype=torch.float64)
    fn = traffic.varlen_flash_standin()
    rec = traffic.make_recorder(device_type="cpu")
    with rec:
        out = fn(q, k, v, traffic.thd_offsets(lengths), 0.3)
        got = torch.autograd.grad(out, (q, k, v), grad)
    names = [r.name for r in rec.records if r.flop_kind == "attention"]
    assert names == ["varlen_flash", "varlen_flash_backward"]

    mask = traffic.document_mask(lengths, s).dense_mask()  # True = masked, [b, 1, s, s]
    ref_in = [t.detach().requires_grad_(True) for t in (q, k, v)]
    qb, kb, vb = (t.permute(1, 2, 0, 3) for t in ref_in)
    kb, vb = kb.repeat_interleave(n // g, 1), vb.repeat_interleave(n // g, 1)
    ref = torch.nn.functional.scaled_dot_product_attention(
        qb, kb, vb, attn_mask=~mask, scale=0.3
    ).permute(2, 0, 1, 3)
    want = torch.autograd.grad(ref, ref_in, grad)
    torch.testing.assert_close(out, ref, rtol=1e-10, atol=1e-10)
    for a, e in zip(got, want):
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-10)


def test_bad_mix_and_scheme_name_the_flag(capsys):
    for argv, words in (
        (["--documents", "zipf:3"], ["--documents", "unknown mix 'zipf:3'"]),
        (["--documents", "uniform:4k-1k"], ["--documents", "LO 4096 > HI 1024"]),
        (
            ["--documents", "uniform:1k-4k", "--schemes", "tsp,fsdp_cp"],
            ["--documents", "--schemes", "not fsdp_cp"],
        ),
        (["--documents", "uniform:1k-4k", "--flash-tiles"], ["--documents", "--flash-tiles"]),
    ):
        with pytest.raises(SystemExit) as exc:
            traffic.parse_args(argv)
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert all(w in err for w in words), err


def test_draws_follow_the_documents_tool():
    """One draw per sample, ``megatron-tsp documents``' seeds; each sample sums to S."""
    from megatron_tsp.tools.estimator import documents

    got = traffic.draw_documents("uniform:1k-4k", 32768, 3, seed=5)
    assert got == documents.draws(documents.parse_mix("uniform:1k-4k"), 32768, 3, 5)
    assert [sum(row) for row in got] == [32768] * 3 and got[0] != got[1]
    assert traffic.draw_documents(None, 32768, 1) is None
