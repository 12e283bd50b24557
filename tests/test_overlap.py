"""(§2) Every K/V collective of a TSP layer is overlapped: posted before at least one GEMM or
attention kernel that does not depend on it (a kernel issued between a transfer's post and its
wait cannot consume its result). Counts the transfers that remain blocking — waited with no such
kernel in between — which must be only the pipelines' fill and drain, independent of D. ~40 s.

Queue order (``megatron_tsp.core.comm``'s queue model, ``CUDA_DEVICE_MAX_CONNECTIONS=1``): the MLP
ring never posts a transfer behind one still in flight without compute in between, so neither the
next weight shard nor any kernel waits for a gradient hop that is not needed yet."""

import pytest

from megatron_tsp.core.layers.mlp import WEIGHT_GRADS, WEIGHTS
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
    # attention: only the first weight broadcast (forward fill); recompute mode also waits for
    # shard 0 at once. The last weight-gradient reduce is covered by the one dgrad GEMM.
    assert attn["fwd"][1] == ["broadcast"]
    expected_bwd = [] if backward == "saved" else ["broadcast"]
    assert sorted(attn["bwd"][1]) == sorted(expected_bwd)
    # the MLP ring: no hop blocks (the one dgrad GEMM covers the accumulator's drain)
    assert mlp["fwd"][1] == [] and mlp["bwd"][1] == [], mlp


@pytest.mark.parametrize("d,backward", [(2, "saved"), (4, "saved"), (4, "recompute")])
def test_attention_queue_order(pool4, d, backward):
    """Under ``CUDA_DEVICE_MAX_CONNECTIONS=1`` no transfer, and so no kernel, is
    queued behind a dK/dV reduce-scatter that is not yet needed: the weight-gradient reduce is
    posted before it, the next head group's transfers and attention backward are queued before
    the reduce-scatter can hold them (``checks_overlap.stalls_behind_large`` states the model)."""
    res = pool4.run(checks_overlap.attention_queue_order, d, backward)[0]
    assert res["bwd"] == [] and res["fwd"] == [], (res["bwd"], res["fwd"], res["order"])


@pytest.mark.parametrize("d", [2, 4])
@pytest.mark.parametrize("recompute", [False, True])
def test_mlp_queue_order(pool4, d, recompute):
    res = pool4.run(checks_overlap.trace_mlp_queue, d, "bfloat16", recompute_activation=recompute)[
        0
    ]
    print(f"D={d} recompute={recompute}: {res}")
    n = res["shard_elems"]
    weights, grads = (WEIGHTS, 2 * n), (WEIGHT_GRADS, 4 * n)  # bf16 shard, fp32 accumulator
    assert res["fwd"]["posts"] == [weights] * (d - 1)
    # backward: W1 before step 0's kernels; then per step t = 1 .. D-1 the next weight hop
    # W(t+1) (t < D-1, after the dX kernels) and this step's accumulator hop A(t) (after the
    # weight-gradient GEMMs onto it), the last one the drain:
    # W1 | W2 A1 | W3 A2 | ... | W(D-1) A(D-2) | A(D-1)
    expected = [weights]
    for t in range(1, d):
        expected += ([weights] if t < d - 1 else []) + [grads]
    assert res["bwd"]["posts"] == expected
    # nothing posted behind a transfer in flight without compute in between
    assert res["fwd"]["stalls"] == [] and res["bwd"]["stalls"] == [], res
    # no hop is waited with no kernel in between: the one dgrad GEMM covers the drain
    assert res["fwd"]["blocking"] == [] and res["bwd"]["blocking"] == []
    # accumulators (output, grad_x, weight-gradient shards) start from their first partial
    # product: nothing is zeroed and read back
    assert res["fwd"]["fills"] == [] and res["bwd"]["fills"] == [], res
