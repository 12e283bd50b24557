"""(§2) Every K/V collective of a TSP layer is overlapped: posted before at least one GEMM or
attention kernel that does not depend on it (a kernel issued between a transfer's post and its
wait cannot consume its result). Counts the transfers that remain blocking — waited with no such
kernel in between — which must be only the pipelines' fill and drain, independent of D. ~40 s."""

import pytest

from tests import checks_overlap

KV_OPS = ("all_gather_into_tensor", "reduce_scatter_tensor")


@pytest.mark.parametrize("d,backward", [(2, "saved"), (4, "saved"), (4, "recompute")])
def test_kv_collectives_overlap(pool4, d, backward):
    # Reads comm's own post/wait events (``comm.observe``), not when torch.distributed runs the
    # transfer, so it holds with late completion on too (TSP_TEST_LATE_COMPLETION=1).
    res = pool4.run(checks_overlap.trace_layer_overlap, d, backward)[0]
    attn, mlp = res["attention"], res["mlp"]
    total = sum(res[k][p][0] for k in res for p in ("fwd", "bwd"))
    blocked = [op for k in res for p in ("fwd", "bwd") for op in res[k][p][1]]
    print(f"D={d} {backward}: {len(blocked)} of {total} transfers blocking: {res}")
    # the schedule's transfer counts: attention D bcast + D gathers forward; backward D bcast,
    # D re-gathers, D reduce-scatters, D reduces; MLP ring D-1 forward, 2(D-1) backward
    assert attn["fwd"][0] == 2 * d and attn["bwd"][0] == 4 * d
    assert mlp["fwd"][0] == d - 1 and mlp["bwd"][0] == 2 * (d - 1)
    assert total == 9 * d - 3
    for phase in ("fwd", "bwd"):
        assert not [op for op in attn[phase][1] if op in KV_OPS], (phase, attn)
    # attention: only the first weight broadcast (forward fill) and, in saved mode, the last
    # weight-gradient reduce (backward drain); recompute mode also waits for shard 0 at once
    assert attn["fwd"][1] == ["broadcast"]
    expected_bwd = ["reduce"] if backward == "saved" else ["broadcast", "reduce"]
    assert sorted(attn["bwd"][1]) == sorted(expected_bwd)


@pytest.mark.parametrize("d,backward", [(2, "saved"), (4, "saved"), (4, "recompute")])
def test_attention_queue_order(pool4, d, backward):
    """Issue 18 §2: under ``CUDA_DEVICE_MAX_CONNECTIONS=1`` no transfer, and so no kernel, is
    queued behind a dK/dV reduce-scatter that is not yet needed: the weight-gradient reduce is
    posted before it, the next head group's transfers and attention backward are queued before
    the reduce-scatter can hold them (``checks_overlap.queue_stalls`` states the model)."""
    res = pool4.run(checks_overlap.attention_queue_order, d, backward)[0]
    assert res["bwd"] == [] and res["fwd"] == [], (res["bwd"], res["fwd"], res["order"])
