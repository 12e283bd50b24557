"""(b) whole GPTModel under TSP vs single-process stock GPTModel; (c) vs Megatron TP=D+SP;
(d) state-dict interop with Megatron TP=D both ways.

References are stock megatron-core only: the TP=1 model uses Megatron's local spec with its own
CPU norms; the TP=D+SP model uses Megatron's local spec with norms written from their formula
(``tests.common.reference_tp_sp_block_spec``). Comparisons run in the ranks (``assert_close``).
"""

import pytest

from tests import checks_gpt

DS = [1, 2, 4]


@pytest.mark.parametrize("style", ["gpt2", "llama"])
@pytest.mark.parametrize("d", DS)
def test_gpt_matches_single_process_fp64(pool4, seed, d, style):
    """Exact loss path (vocab-gathered logits, fp64 cross-entropy), partial loss mask."""
    pool4.run(checks_gpt.check_gpt_vs_single, d, seed, style, rtol=1e-10)


@pytest.mark.parametrize("style", ["gpt2", "llama"])
@pytest.mark.parametrize("d", [2, 4])
def test_gpt_megatron_loss_path_fp32(pool4, seed, d, style):
    """Megatron's own vocab-parallel cross-entropy and loss normalisation, fp32."""
    pool4.run(
        checks_gpt.check_gpt_vs_single,
        d,
        seed,
        style,
        dtype_name="float32",
        loss_path="megatron",
        rtol=1e-5,
    )


@pytest.mark.parametrize("style", ["gpt2", "llama"])
def test_tp_sp_reference_matches_single_process(pool4, seed, style):
    """The TP+SP reference itself (formula norms) equals the TP=1 stock model, so the TSP-vs-TP+SP
    comparison below is against a trustworthy baseline."""
    pool4.run(checks_gpt.check_gpt_vs_single, 4, seed, style, baseline="tp_sp", rtol=1e-10)


def _vs_tp_sp_megatron_loss_path(pool4, seed, d, style, **kw):
    """TSP vs Megatron TP=D+SP through Megatron's vocab-parallel loss path (fp32: Megatron's
    cross-entropy computes in fp32)."""
    pool4.run(
        checks_gpt.check_tsp_vs_tp_sp,
        d,
        seed,
        style,
        dtype_name="float32",
        loss_path="megatron",
        rtol=1e-5,
        **kw,
    )


@pytest.mark.parametrize("style", ["gpt2", "llama"])
@pytest.mark.parametrize("d", [2, 4])
def test_tsp_equals_megatron_tp_sp(pool4, seed, d, style):
    pool4.run(checks_gpt.check_tsp_vs_tp_sp, d, seed, style, rtol=1e-10)
    _vs_tp_sp_megatron_loss_path(pool4, seed, d, style)


@pytest.mark.parametrize("d,groups", [(4, 2), (4, 1), (2, 1)])
def test_fewer_kv_heads_than_d(pool4, seed, d, groups):
    """num_query_groups < D (Llama style, 8 heads): megatron-core's TP layout, K/V heads shared by
    D / groups ranks. Stock TP=D+SP itself equals the TP=1 model there (the baseline is sound),
    TSP equals both in fp64, and state dicts load both ways with ``strict=True``."""
    for baseline in ("tp_sp", "tsp"):
        pool4.run(
            checks_gpt.check_gpt_vs_single,
            d,
            seed,
            "llama",
            baseline=baseline,
            rtol=1e-10,
            groups=groups,
        )
    pool4.run(checks_gpt.check_tsp_vs_tp_sp, d, seed, "llama", rtol=1e-10, groups=groups)


@pytest.mark.parametrize(
    "d,style,groups,hidden,kv_channels",
    [
        (2, "llama", 4, 32, 8),  # GQA, head dim 8 > hidden / heads = 4
        (4, "llama", 2, 32, 2),  # 2 K/V heads < D, head dim 2 < 4
        (4, "gpt2", None, 32, 6),  # MHA, biases, learned positions, head dim 6 > 4
        (4, "llama", 1, 36, 8),  # one K/V head, hidden 36 not a multiple of the 8 heads
    ],
)
def test_kv_channels_not_hidden_over_heads(pool4, seed, d, style, groups, hidden, kv_channels):
    """A head dimension other than hidden / heads (``kv_channels``, --kv-channels: Qwen3,
    Mistral-Nemo), 8 heads: stock TP=D+SP equals the TP=1 model (the baseline is sound), TSP
    equals both in fp64 (loss and every gradient), state dicts load both ways with
    ``strict=True``."""
    kw = dict(rtol=1e-10, groups=groups, hidden=hidden, kv_channels=kv_channels)
    for baseline in ("tp_sp", "tsp"):
        pool4.run(checks_gpt.check_gpt_vs_single, d, seed, style, baseline=baseline, **kw)
    pool4.run(checks_gpt.check_tsp_vs_tp_sp, d, seed, style, **kw)


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("style", ["gpt2", "llama"])
@pytest.mark.parametrize("d", [1, 2, 4])
def test_vocab_ring_loss_matches_single_process_fp64(pool4, seed, d, style, tied):
    """The TSP loss on the vocabulary ring (``core.output_head``: the output weight's shards
    circulate, each rank's per-token losses over the whole vocabulary, gathered to [b, S]) against
    the single-process model's fp64 cross-entropy: loss and every gradient (the output weight's,
    or with tied embeddings the embedding's, summed over the ring), partial loss mask."""
    pool4.run(
        checks_gpt.check_gpt_vs_single, d, seed, style, rtol=1e-10, vocab_ring=True, tied=tied
    )


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("style", ["gpt2", "llama"])
@pytest.mark.parametrize("d", [2, 4])
def test_vocab_ring_equals_megatron_tp_sp_loss_path(pool4, seed, d, style, tied):
    """TSP with the vocabulary ring against stock Megatron TP=D+SP with its vocab-parallel
    cross-entropy (both from labels)."""
    _vs_tp_sp_megatron_loss_path(pool4, seed, d, style, vocab_ring=True, tied=tied)
