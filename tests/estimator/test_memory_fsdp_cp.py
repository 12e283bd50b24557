"""FSDP x CP in the fake-tensor memory tool (``megatron-tsp memory --scheme fsdp_cp``) and the
planner's ``fsdp_cp`` memory against it.

The tool runs megatron-core's GPTModel with TP = 1, CP = N (the CP attention stand-in: TE's K/V
all-gather, or with ``--cp-comm-type p2p`` TE's P2P ring, ``fake_run.KVRingAttention``) sharded
by torch FSDP2 ``fully_shard`` per layer and root (``fake_run`` / ``fsdp_run``). Checked here,
for both K/V exchanges: the fake-tensor peak against the real CPU allocator's peak of the same
step (small model, within 10%, as ``test_memory.py`` does for the other schemes), the static
state and every collective's bytes and calls against hand counts from the architecture, the CLI
and its argument errors, and the planner's peak (``fsdp_cp`` / ``fsdp_cp_ring``) within 5% of the
tool's at five shapes each including 7B / 128k / N = 8 (one fresh process per shape; the 7B
fake step itself takes ~5 s); and the ring stand-in's numerics against dense causal attention
in fp64 (output, dq, the dK/dV that reaches the rank). About 4-5 min on 2 idle cores.
"""

from __future__ import annotations

import pytest

from megatron_tsp.core.model_shape import load_model
from megatron_tsp.tools.estimator import fake_run
from megatron_tsp.tools.estimator.fake_run import RunConfig, run_step
from megatron_tsp.tools.estimator.memory import main as memory_main
from tests.estimator.fake_world_fixture import _fake_world_teardown  # noqa: F401
from tests.estimator.planner_check import run
from tests.estimator.planner_fsdp_vs_fake import RING_FLAG as RING

# the "small" model (h=256, 4 layers, 8 heads, FFN 4h, vocab 2048, LayerNorm, no linear bias,
# untied): peaks of ~50 MB at S=2048 on N=4, where the CPU kernel's per-thread scratch is noise
SMALL = load_model("small")
H, LAYERS, VOCAB, S, N = 256, 4, 2048, 2048, 4


def _cfg(fake=True, **kw):
    base = dict(model=SMALL, world_size=N, tp=1, cp=N, seq=S, count_flops=False, fake=fake)
    base.update(kw)
    return RunConfig(scheme="fsdp_cp", **base)


def _layer_params():
    """One layer's parameters by hand: qkv (3h x h), proj (h x h), fc1 (4h x h), fc2 (h x 4h),
    no bias; two LayerNorms (weight + bias)."""
    return 12 * H * H + 2 * 2 * H


def _root_params():
    """The root FSDP unit: embedding and output layer (vocab 2048 needs no padding at TP 1),
    final LayerNorm."""
    return 2 * VOCAB * H + 2 * H


# ------------------------------------------------------------------------------------------
# fake-tensor peak vs. the real allocator


@pytest.mark.parametrize("cp_comm_type", ["all_gather", "p2p"])
@pytest.mark.parametrize("recompute", ["none", "full"])
def test_fake_peak_matches_real_run(recompute, cp_comm_type):
    """Fake-tensor MemTracker peak vs. the CPU allocator's peak of the same FSDP2 step run with
    real tensors in a fresh process (profiler memory events, no tracker attached)."""
    kw = dict(recompute=recompute, count_comm=False, cp_comm_type=cp_comm_type)
    fake = run_step(_cfg(**kw))
    real = fake_run.run_step_isolated(_cfg(fake=False, **kw))
    assert real.real_peak_bytes > 0
    err = abs(fake.peak_bytes - real.real_peak_bytes) / real.real_peak_bytes
    assert err < 0.10, (recompute, cp_comm_type, fake.peak_bytes, real.real_peak_bytes)
    assert fake.static_bytes == real.static_bytes


# ------------------------------------------------------------------------------------------
# static state and communication by hand


def test_static_state_and_collectives_by_hand():
    """1/N of every parameter in fp32 (FSDP2's shards are the master weights), Adam's m and v,
    no gradient between steps; every unit's weights all-gathered in bf16 in forward and again in
    backward (``reshard_after_forward=True``, root included), its gradient reduce-scattered in
    bf16, K/V all-gathered per layer in forward and backward and dK/dV reduce-scattered. The
    fake process group counts (N-1)/N of each collective's full tensor as received."""
    r = run_step(_cfg())
    total = LAYERS * _layer_params() + _root_params()
    local = total // N  # every dimension 0 here is a multiple of N: no padding
    assert r.params_local == local
    assert r.static_bytes["Parameter"] == 4 * local
    assert r.static_bytes["Gradient"] == 0
    # m + v, and one fp32 step counter per parameter tensor (8 per layer, 4 in the root)
    assert r.static_bytes["Optstate"] == 8 * local + 4 * (8 * LAYERS + 4)

    f = (N - 1) / N
    weights = f * total * 2  # one bf16 all-gather of every unit
    kv = f * 2 * S * H * 2  # one layer's K/V (or dK/dV) over the whole sequence, bf16
    assert r.comm["recv_bytes_forward"] == weights + LAYERS * kv
    # re-gather + gradient reduce-scatter of every unit; K/V re-gather and dK/dV
    assert r.comm["recv_bytes_backward"] == 2 * weights + 2 * LAYERS * kv
    assert r.comm["recv_bytes_grad_sync_and_step"] == 0  # FSDP2 reduced in backward


def test_ring_collectives_by_hand():
    """TE's P2P ring (``--cp-comm-type p2p``) moves the same K/V bytes as the all-gather, in
    P2P steps: a K/V block is one rank's K and V (S/N tokens). Forward: N-1 steps, each receives
    one K/V block; backward: N-1 K/V blocks and N-1 dK/dV blocks received (step 0 sends the K/V
    alone, the last step the dK/dV alone, steps between one packed [K/V, dK/dV] buffer: N
    exchanges). Every exchange is one isend + one irecv (two calls); the weights' collectives
    are the all-gather run's, whose K/V collectives are one all-gather per layer in forward, an
    all-gather and a reduce-scatter per layer in backward."""
    ring = run_step(_cfg(cp_comm_type="p2p", count_flops=False))
    gather = run_step(_cfg(count_flops=False))
    assert ring.label == "FSDPxCP4 p2p"
    f = (N - 1) / N
    total = LAYERS * _layer_params() + _root_params()
    weights = f * total * 2
    block = (S // N) * 2 * H * 2  # one rank's K and V, bf16
    assert ring.comm["recv_bytes_forward"] == weights + LAYERS * (N - 1) * block
    assert ring.comm["recv_bytes_backward"] == 2 * weights + LAYERS * 2 * (N - 1) * block
    assert ring.comm["recv_bytes_grad_sync_and_step"] == 0
    weight_calls_fwd = gather.comm["calls_forward"] - LAYERS
    weight_calls_bwd = gather.comm["calls_backward"] - 2 * LAYERS
    assert ring.comm["calls_forward"] == weight_calls_fwd + LAYERS * 2 * (N - 1)
    assert ring.comm["calls_backward"] == weight_calls_bwd + LAYERS * 2 * N
    # the static state does not depend on the K/V exchange
    assert ring.static_bytes == gather.static_bytes


# ------------------------------------------------------------------------------------------
# CLI


def test_cli_runs_fsdp_cp(capsys):
    args = "--model tiny --scheme fsdp_cp --tp 1 --cp 2 --world-size 2 --seq 512 --no-flops"
    assert memory_main(args.split()) == 0
    out = capsys.readouterr().out
    assert "FSDPxCP2" in out and "peak" in out


@pytest.mark.parametrize("scheme", ["fsdp_cp", "tp_cp"])
def test_cli_runs_ring(scheme, capsys):
    args = f"--model tiny --scheme {scheme} --tp 1 --cp 2 --world-size 2 --seq 512 --no-flops"
    assert memory_main(f"{args} --cp-comm-type p2p".split()) == 0
    out = capsys.readouterr().out
    assert ("FSDPxCP2 p2p" if scheme == "fsdp_cp" else "TP1xCP2 p2p") in out


@pytest.mark.parametrize(
    "args,names",
    [
        ("--scheme fsdp_cp --cp-comm-type ring", ["--cp-comm-type", "ring", "p2p"]),
        ("--scheme tsp --tp 2 --cp 1 --cp-comm-type p2p", ["--cp-comm-type p2p", "tsp"]),
    ],
)
def test_cli_refuses_bad_cp_comm_type_by_name(args, names, capsys):
    with pytest.raises(SystemExit) as exc:
        memory_main(f"{args} --tp 1 --cp 2 --world-size 2 --seq 512".split())
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert all(n in err for n in names), err


@pytest.mark.parametrize(
    "args,names",
    [
        ("--tp 8 --cp 8 --world-size 8", ["--tp must be 1", "got 8"]),
        ("--tp 1 --cp 4 --world-size 8", ["--cp must equal --world-size", "--cp 4", "8"]),
        (
            "--tp 1 --cp 8 --world-size 8 --distributed-optimizer",
            ["--distributed-optimizer"],
        ),
    ],
)
def test_cli_refuses_bad_layouts_by_name(args, names, capsys):
    with pytest.raises(SystemExit) as exc:
        memory_main(f"--scheme fsdp_cp --seq 4096 {args}".split())
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert all(n in err for n in names), err


# ------------------------------------------------------------------------------------------
# the planner against the tool


@pytest.mark.parametrize(
    "args",
    [
        ["check", 8192, 4, "none,full"],  # backward peaks
        ["check", 8192, 2, "none"],  # a forward peak (the output layer)
        ["check", 8192, 4, "none", 2],  # 2 K/V heads
        ["check", 4096, 8, "none", "mha", "tied"],  # tied embeddings, N = 8
        ["7b", 131072, 8, "none,full"],  # 7B / 128k / N = 8
        # TE's P2P ring, the same shapes (the planner's fsdp_cp_ring)
        ["check", 8192, 4, "none,full", RING],
        ["check", 8192, 2, "none", RING],
        ["check", 8192, 4, "none", 2, RING],
        ["check", 4096, 8, "none", "mha", "tied", RING],  # a backward peak
        ["7b", 131072, 8, "none,full", RING],
    ],
    ids=[
        "n4",
        "n2-forward",
        "gqa",
        "tied-n8",
        "7b-128k-n8",
        "ring-n4",
        "ring-n2",
        "ring-gqa",
        "ring-tied-n8",
        "ring-7b-128k-n8",
    ],
)
def test_planner_memory_matches_fake_tool(args):
    rows = run("planner_fsdp_vs_fake.py", args, timeout=900)
    assert rows
    for r in rows:
        err = r["planned"] / r["measured"] - 1
        print(
            f"{r['layout']:<20} measured {r['measured'] / 1e9:8.3f} GB ({r['measured_phase']})"
            f"  planned {r['planned'] / 1e9:8.3f} GB  {100 * err:+.1f}%"
        )
        assert abs(err) <= 0.05, r


# ------------------------------------------------------------------------------------------
# the ring stand-in's numerics (one rank at a time, every other rank's messages computed densely)


@pytest.mark.parametrize("n,rank", [(2, 0), (2, 1), (4, 1), (4, 3)])
def test_ring_attention_matches_dense_causal(n, rank, monkeypatch):
    """``KVRingAttention`` on one rank of a ring of ``n`` against dense causal attention in
    fp64: the output rows and dq of the rank's zigzag chunks, and the dK/dV of its own K/V block
    that reaches it with the last backward step. The P2P exchange is replaced by what the other
    ranks would send: in forward the previous rank's K/V block (rank r-1-i's at step i), in
    backward the next rank's (TE's ring runs the other way) with the dK/dV the ranks r+1 .. r+i
    summed into it (their contributions from the dense reference's per-rank gradients)."""
    import types

    import torch

    seq, b, heads, groups, dim = 8 * n, 1, 4, 2, 8
    c = seq // (2 * n)
    torch.manual_seed(0)
    q, k, v, dout = (
        torch.randn(seq, b, x, dim, dtype=torch.float64) for x in (heads, groups, groups, heads)
    )

    def rows(r):
        return torch.cat(
            [torch.arange(r * c, (r + 1) * c), torch.arange((2 * n - 1 - r) * c, (2 * n - r) * c)]
        )

    def dense(p):
        """Rank p's output rows, and the gradients of sum(out_p * dout_p) wrt q, k, v."""
        qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
        rep = heads // groups
        att = torch.nn.functional.scaled_dot_product_attention(
            qq.permute(1, 2, 0, 3),
            kk.repeat_interleave(rep, 2).permute(1, 2, 0, 3),
            vv.repeat_interleave(rep, 2).permute(1, 2, 0, 3),
            is_causal=True,
        ).permute(2, 0, 1, 3)[rows(p)]
        (att * dout[rows(p)]).sum().backward()
        return att.detach(), qq.grad, kk.grad, vv.grad

    refs = [dense(p) for p in range(n)]

    def block(j):
        return torch.stack((k[rows(j)], v[rows(j)]))

    def dkv_from(ps, j):  # the dK/dV of block j summed over ranks ps
        dk = sum(refs[p][2][rows(j)] for p in ps)
        dv = sum(refs[p][3][rows(j)] for p in ps)
        return torch.stack((dk, dv))

    calls = []

    def exchange(send, recv, group, to_next):
        i = len(calls)
        calls.append(to_next)
        if to_next:  # forward step i: rank r-1's block, which it held at step i
            recv.copy_(block((rank - 1 - i) % n))
            return
        i -= n - 1  # backward step i: from rank r+1, its step-i send
        kv = block((rank + 2 + i) % n)
        if i == 0:
            recv.copy_(kv)
            return
        dkv = dkv_from([(rank + 1 + m) % n for m in range(i)], (rank + 1 + i) % n)
        recv.copy_(dkv if i == n - 1 else torch.stack((kv, dkv)))

    fake_dist = types.SimpleNamespace(get_world_size=lambda g: n, get_rank=lambda g: rank)
    monkeypatch.setattr(fake_run, "dist", fake_dist)
    monkeypatch.setattr(fake_run, "_ring_send_recv", exchange)
    mine = rows(rank)
    ql, kl, vl = (t[mine].clone().requires_grad_(True) for t in (q, k, v))
    out = fake_run.KVRingAttention.apply(ql, kl, vl, dim**-0.5, object())
    out.backward(dout[mine])
    assert calls == [True] * (n - 1) + [False] * n
    torch.testing.assert_close(out, refs[rank][0])
    torch.testing.assert_close(ql.grad, refs[rank][1][mine])
    full = dkv_from(range(n), rank)
    torch.testing.assert_close(kl.grad, full[0])
    torch.testing.assert_close(vl.grad, full[1])
