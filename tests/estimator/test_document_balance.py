"""Packed-document attention balance (``tools/estimator/documents.py``) and the planner's
``--documents`` term.

The per-rank pair and tile counts are checked against a brute force that knows nothing of the
piece arithmetic: every token's owner rank from the layout's definition, the dense in-document
causal mask, and the set of tiles its nonzero entries fall in (small S, random mixes)."""

import random

import pytest
import torch

from megatron_tsp.tools.estimator import documents as docs
from megatron_tsp.tools.estimator import formulas as fm
from megatron_tsp.tools.estimator import planner, timing
from megatron_tsp.tools.estimator.formulas import LayerShape
from megatron_tsp.tools.estimator.strategies import Options, make_strategy


# ---------------------------------------------------------------------------------------------
# brute force: owners from the layouts' definitions, the dense mask, tiles as sets
# ---------------------------------------------------------------------------------------------
def _zigzag_owner(n: int, D: int):
    """(rank, chunk) of each position of an n-token stream padded to 2D chunks; None = pad."""
    c = -(-n // (2 * D))
    return [(k if k < D else 2 * D - 1 - k, k) for k in (p // c for p in range(n))]


def _segments(lengths, layout):
    """Document ids per zigzagged segment: all of them (zigzag), each alone (thd), or those of
    >= T tokens alone and the rest as one stream (split-T)."""
    if layout == "zigzag":
        return [list(range(len(lengths)))]
    t = 1 if layout == "thd" else docs.parse_size(layout[6:])
    long = [[i] for i, n in enumerate(lengths) if n >= t]
    return long + [[i for i, n in enumerate(lengths) if n < t]]


def _tokens(lengths, D, layout):
    """Per real token in natural order: (doc, position in doc, rank, piece key), where a piece
    is the (segment, chunk) the token's query row runs in."""
    segments = _segments(lengths, layout)
    info = {}
    for g, seg in enumerate(segments):
        n = sum(lengths[i] for i in seg)
        owners, pos = _zigzag_owner(n, D), 0
        for i in seg:
            for j in range(lengths[i]):
                rank, chunk = owners[pos]
                info[(i, j)] = (rank, (g, chunk))
                pos += 1
    return [(i, j, *info[(i, j)]) for i, n in enumerate(lengths) for j in range(n)]


def _brute(lengths, D, layout, tile):
    """Per-rank pairs and tiles from the dense in-document causal mask."""
    toks = _tokens(lengths, D, layout)
    S = len(toks)
    doc = torch.tensor([t[0] for t in toks])
    mask = (doc[:, None] == doc[None, :]) & torch.ones(S, S, dtype=torch.bool).tril()
    pairs, tiles = [0] * D, [set() for _ in range(D)]
    piece_start = {}
    for p, (_, _, r, key) in enumerate(toks):
        piece_start.setdefault((key, toks[p][0]), p)
    doc_start = {}
    for p, (i, _, _, _) in enumerate(toks):
        doc_start.setdefault(i, p)
    for q in range(S):
        i, _, r, key = toks[q]
        keys = mask[q].nonzero().flatten().tolist()
        pairs[r] += len(keys)
        q0 = piece_start[(key, i)]
        for k in keys:  # query tiles from the piece's start, key tiles from the document's
            tiles[r].add((key, i, (q - q0) // tile, (k - doc_start[i]) // tile))
    return pairs, [len(t) for t in tiles]


def _random_lengths(rng, S):
    out, left = [], S
    while left:
        out.append(min(left, rng.choice([1, 2, 3, 5, 8, 13, 21, 40, S])))
        left -= out[-1]
    return out


CASES = [(S, D, seed) for S, D in ((48, 2), (96, 3), (128, 4)) for seed in range(4)]


@pytest.mark.parametrize("S,D,seed", CASES)
@pytest.mark.parametrize("layout", ["zigzag", "thd", "split-16"])
def test_pairs_and_tiles_equal_the_dense_mask(S, D, seed, layout):
    lengths = _random_lengths(random.Random(seed * 7919 + S), S)
    w = docs.layout_work(layout, lengths, D, tile=4)
    pairs, tiles = _brute(lengths, D, layout, tile=4)
    assert w.pairs == pairs
    assert w.tiles == tiles
    assert sum(w.pairs) == docs.document_pairs(lengths)
    real = sum(lengths)
    seg_sizes = [sum(lengths[i] for i in seg) for seg in _segments(lengths, layout)]
    assert w.padding == sum(-n % (2 * D) for n in seg_sizes)
    assert w.kv_tokens == real + w.padding


@pytest.mark.parametrize("S,D,K", [(48, 2, 4), (96, 3, 2), (128, 4, 4)])
def test_document_aware_chunks_equal_the_dense_mask(S, D, K):
    """chunks-K: each rank's pairs are the dense count over the chunks it was assigned; every
    rank holds K chunks (S/D tokens); a chunk's work is the dense count of its rows."""
    lengths = _random_lengths(random.Random(S + K), S)
    w = docs.chunks(lengths, D, K, tile=4)
    n, c = D * K, S // (D * K)
    toks = _tokens(lengths, D, "zigzag")
    doc = torch.tensor([t[0] for t in toks])
    mask = (doc[:, None] == doc[None, :]) & torch.ones(S, S, dtype=torch.bool).tril()
    per_chunk = [int(mask[i * c : (i + 1) * c].sum()) for i in range(n)]
    owned = docs.assign_chunks(per_chunk, D, K)
    assert sorted(sum(owned, [])) == list(range(n)) and all(len(x) == K for x in owned)
    assert w.pairs == [sum(per_chunk[i] for i in ids) for ids in owned]
    assert w.padding == 0 and w.kv_tokens == S


def test_a_planted_defect_is_caught(monkeypatch):
    """The brute-force comparison fails when the piece arithmetic is off by one."""
    lengths = _random_lengths(random.Random(3), 96)
    good = docs._piece_pairs
    monkeypatch.setattr(docs, "_piece_pairs", lambda x, y, s: good(x, y, s) + (y - x > 3))
    with pytest.raises(AssertionError):
        assert docs.zigzag(lengths, 3, tile=4).pairs == _brute(lengths, 3, "zigzag", 4)[0]


@pytest.mark.parametrize("S,D", [(16, 1), (64, 2), (4096, 8), (131072, 8), (12288, 6)])
def test_one_document_is_the_zigzag(S, D):
    """One causal document under today's zigzag: chunk k (C tokens) has C*kC + C(C+1)/2 pairs,
    so ranks r (chunks r, 2D-1-r) all do C^2 (2D-1) + C (C+1): balance exactly 1."""
    C = S // (2 * D)
    w = docs.zigzag([S], D)
    assert w.pairs == [C * C * (2 * D - 1) + C * (C + 1)] * D
    assert w.balance == 1.0 and w.tile_balance == 1.0 and w.reorder_tokens == 0


def test_zigzag_imbalance_by_hand():
    """Two documents of S/2 at D = 2 (chunks of S/4): rank 0 holds chunks 0 and 3 (first rows of
    both documents), rank 1 chunks 1 and 2 (their last rows)."""
    c = 16
    w = docs.zigzag([32, 32], 2, tile=0)
    first, second = c * (c + 1) // 2, c * c + c * (c + 1) // 2
    assert w.pairs == [first + second, second + first]  # symmetric: balanced
    w = docs.zigzag([16, 48], 2, tile=0)
    assert w.pairs == [2 * c * c + c * (c + 1), c * c + c * (c + 1)]
    assert w.balance == max(w.pairs) * 2 / sum(w.pairs) > 1


# ---------------------------------------------------------------------------------------------
# mixes
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "spec", ["uniform:1k-32k", "heavy:0.7,256-128k", "long+short:96k,1k-4k", "fixed:3k,5k"]
)
def test_mixes_fill_the_sequence_within_their_ranges(spec):
    mix = docs.parse_mix(spec)
    for lengths in docs.draws(mix, 131072, 4, seed=1):
        assert sum(lengths) == 131072 and min(lengths) >= 1
        body = lengths[:-1]  # the last one is cut at S
        if mix.kind in ("uniform", "heavy"):
            assert all(mix.lo <= n <= mix.hi for n in body)
        if mix.kind == "long+short":
            assert 96 * 1024 in lengths
    assert docs.draws(mix, 131072, 2, seed=5) == docs.draws(mix, 131072, 2, seed=5)


def test_heavy_mix_is_the_truncated_pareto():
    """The empirical tail P(L > x) of heavy:ALPHA,LO-HI follows the truncated Pareto."""
    mix, rng = docs.parse_mix("heavy:0.7,256-128k"), random.Random(0)
    xs = [mix._short(rng) for _ in range(40000)]
    lo, hi, a = 256, 131072, 0.7
    for x in (1024, 16384):
        want = ((lo / x) ** a - (lo / hi) ** a) / (1 - (lo / hi) ** a)
        got = sum(v > x for v in xs) / len(xs)
        assert abs(got - want) < 0.01, (x, got, want)


@pytest.mark.parametrize(
    "spec,words",
    [
        ("uniform:32k-1k", ["--documents", "32768", "1024"]),
        ("uniform:1k", ["--documents", "LO-HI"]),
        ("heavy:-1,1k-2k", ["--documents", "ALPHA", "-1"]),
        ("zipf:3", ["--documents", "zipf"]),
        ("fixed:3k,0", ["--documents", "'0'"]),
        ("single:5", ["--documents", "single"]),
        ("long+short:96k", ["--documents", "LO-HI", "long+short:96k"]),
    ],
)
def test_bad_mixes_name_the_flag_and_numbers(spec, words):
    with pytest.raises(ValueError) as exc:
        docs.parse_mix(spec)
    assert all(w in str(exc.value) for w in words), str(exc.value)


def test_chunk_count_must_divide_the_sequence():
    with pytest.raises(
        ValueError, match=r"--layouts chunks-3: --seq-length 64 .* 3 x --degree 2 = 6"
    ):
        docs.layout_work("chunks-3", [64], 2)


def test_plan_refuses_a_bad_mix_in_one_line(capsys):
    with pytest.raises(SystemExit) as exc:
        planner.main(["--seq-length", "4096", "--gpus", "8", "--documents", "uniform:9k-1k"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--documents" in err[0] and "9216" in err[0]


def test_documents_cli_prints_the_table(capsys):
    rc = docs.main(
        ["--documents", "single", "--documents", "uniform:1k-4k", "--seq-length", "16384"]
        + ["--draws", "2", "--layouts", "zigzag,thd,chunks-4"]
    )
    out = capsys.readouterr().out
    assert rc == 0
    rows = [x for x in out.splitlines() if x.startswith("| `")]
    assert len(rows) == 6 and "| `single` | zigzag | 1.0 | 1.000 / 1.000 |" in rows[0]


# ---------------------------------------------------------------------------------------------
# the planner
# ---------------------------------------------------------------------------------------------
S7B = 65536


def _rows(o, kinds=("tsp", "tp_sp", "cp")):
    return {k: timing.evaluate("7b", "h100", make_strategy(k, 8), S7B, 8, o) for k in kinds}


def test_one_document_is_todays_planner():
    """--documents single: every number of the plan equals the plan without documents."""
    base = _rows(Options(compute_model="flops"))
    single = _rows(Options(compute_model="flops", documents="single"))
    for k in base:
        for key in ("layer_compute_s", "layer_exposed_s", "step_s", "mfu", "tokens_per_s"):
            assert single[k][key] == base[k][key], (k, key)


def _by_hand_factors(lengths, D):
    """sum L^2 / S^2 and the zigzag's max / mean, by a per-query loop."""
    S, C = sum(lengths), sum(lengths) // (2 * D)
    work, pos = [0] * D, 0
    for n in lengths:
        for p in range(pos, pos + n):
            k = p // C
            work[k if k < D else 2 * D - 1 - k] += p - pos + 1
        pos += n
    return sum(n * n for n in lengths) / S**2, max(work) * D / sum(work)


def test_planner_attention_follows_the_document_pairs():
    """fixed:32k,16k,8k,8k at S = 64k (every draw the same): the attention FLOPs are
    2*2*B*h*sum L^2/2 (model FLOPs, every strategy); TSP's attention time scales by the
    zigzag's max / mean, TP+SP's by nothing, CP's by THD's (these documents: exactly 1)."""
    lengths, spec = [32768, 16384, 8192, 8192], "fixed:32k,16k,8k,8k"
    pairs, bal = _by_hand_factors(lengths, 8)
    assert bal > 1.05  # the case is not trivially balanced
    o0, o = Options(compute_model="flops"), Options(compute_model="flops", documents=spec)
    shape = LayerShape.of(planner.load_model("7b"), 1, S7B)
    tsp, tp_sp, cp = (make_strategy(k, 8) for k in ("tsp", "tp_sp", "cp"))
    attn = fm.layer_flops(shape, causal_fraction=timing.causal_fraction(tsp, o, S7B, False))
    assert attn["fwd_attn_core"] == pytest.approx(
        2 * 2 * shape.hidden * sum(n * n for n in lengths) / 2
    )
    assert timing.causal_fraction(tsp, o, S7B) == pytest.approx(0.5 * pairs * bal, rel=1e-12)
    assert timing.causal_fraction(tp_sp, o, S7B) == pytest.approx(0.5 * pairs, rel=1e-12)
    assert timing.causal_fraction(cp, o, S7B) == pytest.approx(0.5 * pairs, rel=1e-12)
    hw = planner.load_hardware("h100")
    full = fm.layer_flops(shape)["fwd_attn_core"]  # one document
    for s, f in ((tsp, pairs * bal), (tp_sp, pairs), (cp, pairs)):
        a = timing._layer_time(shape, s, hw, o0, False)["compute"]
        b = timing._layer_time(shape, s, hw, o, False)["compute"]
        assert b["fwd"] - a["fwd"] == pytest.approx(full * (f - 1) / 8 / hw.flops, rel=1e-9)
        assert b["bwd"] - a["bwd"] == pytest.approx(2 * full * (f - 1) / 8 / hw.flops, rel=1e-9)
    # model FLOPs (MFU) count the pairs, not the imbalance: TSP's and TP+SP's MFU x step agree
    rows = _rows(o)
    assert rows["tsp"]["mfu"] * rows["tsp"]["step_s"] == pytest.approx(
        rows["tp_sp"]["mfu"] * rows["tp_sp"]["step_s"], rel=1e-12
    )


def test_measured_layers_get_the_flop_difference():
    """A measured (recorded one-document) layer: documents add the FLOP model's difference, a
    single document adds nothing (here with attention recompute and full recompute)."""
    shape = LayerShape.of(planner.load_model("7b"), 1, S7B)
    hw, s = planner.load_hardware("h100"), make_strategy("tsp", 8)
    measured = {"fwd": {"seconds": 1.0}, "bwd": {"seconds": 2.0}}
    for full in (False, True):
        kw = dict(tsp_recompute_attn=True)
        base = timing._layer_time(shape, s, hw, Options(**kw), full, measured)["compute"]
        one = timing._layer_time(shape, s, hw, Options(documents="single", **kw), full, measured)
        assert one["compute"] == base
        o = Options(documents="fixed:32k,16k,8k,8k", **kw)
        got = timing._layer_time(shape, s, hw, o, full, measured)["compute"]
        f = timing.causal_fraction(s, o, S7B) / 0.5
        attn = fm.layer_flops(shape)["fwd_attn_core"] * (f - 1) / 8 / hw.flops
        assert got["fwd"] - base["fwd"] == pytest.approx(attn, rel=1e-9)
        # backward 2x, the attention recompute (or the full forward) once more
        assert got["bwd"] - base["bwd"] == pytest.approx(3 * attn, rel=1e-9)
