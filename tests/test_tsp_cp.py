"""TSP x context parallelism: the D*C sequence layout and fp64 parity.

Layout (single process): megatron-core's tensor-and-context-parallel group order is
``TSPLayout.sequence_rank``; the zigzag over D*C ranks (chunks q and 2DC-1-q) gives every rank
its chunks; CP rank c's batch slice equals Megatron's CP split followed by the D-rank zigzag;
the CP-local RoPE index maps Megatron's CP-local table onto the rank's positions.

Parity ((D, C) = (2, 2) on the shared 4-rank pool, (4, 2) on an 8-rank pool of this module,
~40 s to start on 2 cores): one TSP x CP attention layer and whole GPTModels (GPT-2 and Llama
styles, GQA) equal the single-process reference in fp64 (1e-10): output, loss, every gradient.
"""

import pytest
import torch
from megatron.core.parallel_state import RankGenerator

from megatron_tsp.core.layout import TSPLayout
from tests import checks_inference, checks_tsp_cp


@pytest.fixture(scope="module")
def pool8():
    """Eight gloo ranks for (D, C) = (4, 2), started once for this module."""
    from tests.harness import RankPool

    pool = RankPool(8)
    yield pool
    pool.close()


def _definition(d, c, seq):
    """Sequence rank q of D*C holds chunks q then 2DC-1-q of 2DC, by the definition."""
    n = 2 * d * c
    chunk = seq // n
    return [[k * chunk + i for k in (q, n - 1 - q) for i in range(chunk)] for q in range(d * c)]


@pytest.mark.parametrize("d,c", [(1, 2), (2, 2), (4, 2), (2, 4), (8, 2)])
def test_sequence_rank_is_megatron_tp_cp_group_order(d, c):
    """Rank q of megatron-core's tp-cp group (order tp-cp-ep-dp-pp, with DP and PP) is TSP rank
    q mod D of CP rank q // D, for every global rank."""
    dp, pp = 2, 2
    gen = RankGenerator(tp=d, ep=1, dp=dp, pp=pp, cp=c, order="tp-cp-ep-dp-pp")
    index = {}
    for token in ("tp", "cp", "tp-cp"):
        for ranks in gen.get_ranks(token):
            for i, r in enumerate(ranks):
                index[(token, r)] = i
    layout = TSPLayout(d * c, 2 * d * c, context_parallel_size=c)
    for r in range(d * c * dp * pp):
        tp_rank, cp_rank, q = index[("tp", r)], index[("cp", r)], index[("tp-cp", r)]
        assert TSPLayout.sequence_rank(tp_rank, cp_rank, d) == q
        assert layout.split_rank(q) == (tp_rank, cp_rank)


@pytest.mark.parametrize("d,c", [(1, 2), (2, 2), (4, 2), (2, 3), (8, 2)])
@pytest.mark.parametrize("chunk", [1, 3])
def test_cp_layout_against_definition(d, c, chunk):
    seq = 2 * d * c * chunk
    ranks = _definition(d, c, seq)
    whole = TSPLayout(d * c, seq, context_parallel_size=c)
    assert whole.weight_group_size == d and whole.cp_local_len == seq // c
    natural = torch.arange(seq)
    for cp_rank in range(c):
        # the one batch permutation: CP rank c's slice = its D ranks' positions, in TSP order
        mine = [p for q in range(cp_rank * d, (cp_rank + 1) * d) for p in ranks[q]]
        assert whole.cp_batch_positions(cp_rank).tolist() == mine
        # ... which is Megatron's CP split (CP chunks c, 2C-1-c) then the D-rank zigzag
        cp_chunks = natural.chunk(2 * c)
        megatron_local = torch.cat([cp_chunks[cp_rank], cp_chunks[2 * c - 1 - cp_rank]])
        d_chunks = megatron_local.chunk(2 * d)
        composed = [
            int(t) for r in range(d) for k in (r, 2 * d - 1 - r) for t in d_chunks[k].tolist()
        ]
        assert composed == mine
        for tp_rank in range(d):
            q = TSPLayout.sequence_rank(tp_rank, cp_rank, d)
            layout = TSPLayout(d * c, seq, q, context_parallel_size=c)
            assert layout.positions().tolist() == ranks[q]
            # Megatron's CP-local table indexed by cp_local_positions = the rank's positions
            assert megatron_local[layout.cp_local_positions()].tolist() == ranks[q]


def test_cp_layout_refusals():
    with pytest.raises(ValueError, match="context-parallel size 3 must be a positive integer"):
        TSPLayout(4, 16, context_parallel_size=3)
    with pytest.raises(ValueError, match="CP rank 2 is outside a context-parallel group of 2"):
        TSPLayout(4, 16, context_parallel_size=2).cp_batch_positions(2)


def test_cp_batch_hook(pool4, seed):
    pool4.run(checks_tsp_cp.check_cp_batch, 2, 2, seed)


@pytest.mark.parametrize(
    "groups,bias,rope,backward",
    [(4, True, True, "saved"), (8, False, True, "recompute"), (1, True, False, "saved")],
)
def test_attention_layer_fp64(pool4, seed, groups, bias, rope, backward):
    """(D, C) = (2, 2): GQA (4 K/V heads), MHA with recompute, and one K/V head (fewer than D)."""
    pool4.run(
        checks_tsp_cp.check_attention_cp,
        2,
        2,
        seed,
        groups=groups,
        bias=bias,
        rope=rope,
        attention_backward=backward,
    )


@pytest.mark.parametrize("style,groups", [("gpt2", None), ("llama", None), ("llama", 1)])
def test_gpt_matches_single_process_fp64(pool4, seed, style, groups):
    """(D, C) = (2, 2): loss and every gradient of GPT-2 and Llama (GQA: 4 and 1 K/V heads)."""
    pool4.run(checks_tsp_cp.check_gpt_cp, 2, 2, seed, style, groups=groups, rtol=1e-10)


def test_gpt_kv_channels_fp64(pool4, seed):
    """(D, C) = (2, 2), Llama with one K/V head: head dimension 8, not hidden / heads = 4
    (``kv_channels``): loss and every gradient."""
    pool4.run(checks_tsp_cp.check_gpt_cp, 2, 2, seed, "llama", groups=1, kv_channels=8, rtol=1e-10)


def test_layer_cp_4_ranks_as_c4(pool4, seed):
    """(D, C) = (1, 4): the sequence group is the CP group alone (one-rank TSP groups)."""
    pool4.run(checks_tsp_cp.check_attention_cp, 1, 4, seed, groups=4)


@pytest.mark.parametrize("backward,a2a", [("saved", False), ("recompute", False), ("saved", True)])
def test_attention_layer_late_completion(pool4, seed, backward, a2a):
    """The K/V gathers and dK/dV reduce-scatters (``a2a``: all-to-alls, --tsp-kv-grad-all-to-all)
    over the D*C group, with transfers completing as late as on a GPU
    (``tests/late_completion.py``): no buffer touched while in flight, results exact."""
    pool4.run(
        checks_tsp_cp.check_attention_cp,
        2,
        2,
        seed,
        groups=4,
        attention_backward=backward,
        kv_grad_all_to_all=a2a,
        late_completion=True,
    )


@pytest.mark.slow
def test_d4_c2_layer_and_gpt_fp64(pool8, seed):
    """(D, C) = (4, 2) on 8 ranks: the layer with 4 K/V heads (saved) and with 2 (< D, recompute),
    GPT-2 and Llama (GQA) models, and generation (TSP x CP prefill, TP decode)."""
    pool8.run(checks_tsp_cp.check_cp_batch, 4, 2, seed)
    pool8.run(checks_tsp_cp.check_attention_cp, 4, 2, seed, groups=4)
    pool8.run(
        checks_tsp_cp.check_attention_cp, 4, 2, seed, groups=2, attention_backward="recompute"
    )
    for style in ("gpt2", "llama"):
        pool8.run(checks_tsp_cp.check_gpt_cp, 4, 2, seed, style, rtol=1e-10)
    # Inference: TSP4 x CP2 prefill over 8 ranks (GQA with fewer K/V heads than D), TP=4 decode
    # on CP rank 0, tokens equal to the single-process model's (tests/test_inference.py: D=2).
    results = pool8.run(checks_inference.check_generation_cp, 4, 2, seed, "llama", groups=2)
    worst = {k: max(r.get(k, 0.0) for r in results) for k in results[0]}
    assert max(worst.values()) <= 1e-12, worst
