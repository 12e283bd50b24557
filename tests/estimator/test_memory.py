"""Tests for the fake-tensor memory / FLOP measurement (``megatron-tsp memory``).

Fast tests (~2 min on 2 idle cores): the baselines' core attention against dense attention,
fake-tensor peak vs. the real CPU allocator's peak for every scheme at small scale (within 10%),
the CLI smoke runs, and the FLOP accounting of TSP against TP+SP. The test marked ``slow`` runs
one full-scale rank (7B, S=128k, D=8, ~2.5 min) and still runs in CI; deselect it locally with
``-m "not slow"``.
"""

from __future__ import annotations

import dataclasses
import json
import warnings

import pytest
import torch
import torch.nn.functional as F

warnings.filterwarnings("ignore", message=".*Transformer Engine.*")
warnings.filterwarnings("ignore", message=".*Apex.*")

from megatron_tsp.core.layout import TSPLayout, whole_sequence_blocks  # noqa: E402
from megatron_tsp.core.model_shape import ModelShape, load_model  # noqa: E402
from megatron_tsp.tools.estimator import fake_run  # noqa: E402
from megatron_tsp.tools.estimator.fake_run import RunConfig, run_step  # noqa: E402
from megatron_tsp.tools.estimator.memory import main as memory_main  # noqa: E402
from tests.common import zigzag_rows  # noqa: E402
from tests.estimator.fake_world_fixture import _fake_world_teardown  # noqa: E402,F401

# h=128, 2 layers, 8 heads, vocab 512: every scheme runs in seconds.
TINY = ModelShape(name="tiny-h128", hidden=128, num_layers=2, heads=8, vocab=512)
SMALL_SEQ = 1024
# h=256, 4 layers, vocab 2048, S=2048 on 4 ranks: peaks of 28-65 MB, where the CPU flash kernel's
# per-thread scratch (invisible to any dispatch-level tracker, ~1.5 MB/thread) is noise.
VALIDATE = dict(model=load_model("small"), seq=2048)


def _cfg(scheme, fake=True, **kw):
    base = dict(model=TINY, world_size=4, tp=4, cp=1, seq=SMALL_SEQ, count_comm=False)
    if scheme == "tp_cp":
        base.update(tp=2, cp=2)
    base.update(kw)
    return RunConfig(scheme=scheme, fake=fake, **base)


# ------------------------------------------------------------------------------------------
# the baselines' core attention (the layers' kernels) is exact


def _dense_lower_right(q, k, v):
    from torch.nn.attention.bias import causal_lower_right

    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=causal_lower_right(q.shape[2], k.shape[2])
    )


def test_baseline_attention_matches_dense_zigzag(seed):
    """Each CP rank's zigzag rows (taken by the chunk definition, ``zigzag_rows``) attend to the
    whole natural-order K/V; outputs equal the dense causal attention's rows, gradients summed
    over the ranks equal the dense gradients."""
    torch.manual_seed(seed)
    cp, s, b, n, d = 3, 48, 2, 4, 8
    q, k, v = (torch.randn(s, b, n, d, dtype=torch.float64, requires_grad=True) for _ in range(3))
    bhsd = lambda t: t.permute(1, 2, 0, 3)  # noqa: E731
    ref = _dense_lower_right(bhsd(q), bhsd(k), bhsd(v)).permute(2, 0, 1, 3).reshape(s, b, -1)
    go = torch.randn_like(ref)
    ref_grads = torch.autograd.grad(ref, (q, k, v), go)
    grads = [torch.zeros_like(t) for t in (q, k, v)]
    for rank in range(cp):
        q_loc = zigzag_rows(q, cp, rank)
        blocks = TSPLayout(cp, s, rank).causal_blocks
        out = fake_run.BaselineCoreAttention.apply(q_loc, k, v, d**-0.5, blocks, None)
        torch.testing.assert_close(out, zigzag_rows(ref, cp, rank))
        g = torch.autograd.grad(out, (q, k, v), zigzag_rows(go, cp, rank))
        grads = [a + bb for a, bb in zip(grads, g)]
    # every rank's contribution summed equals the dense gradient
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want)


def test_baseline_attention_gqa_square(seed):
    torch.manual_seed(seed)
    q = torch.randn(1, 4, 16, 8, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, 16, 8, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 2, 16, 8, dtype=torch.float64, requires_grad=True)
    sbhd = lambda t: t.permute(2, 0, 1, 3)  # noqa: E731
    out = fake_run.BaselineCoreAttention.apply(
        sbhd(q), sbhd(k), sbhd(v), 8**-0.5, whole_sequence_blocks(16), None
    )
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    torch.testing.assert_close(out, sbhd(ref).reshape(16, 1, -1))
    g1 = torch.autograd.grad(out.sum(), (q, k, v))
    g2 = torch.autograd.grad(ref.sum(), (q, k, v))
    for a, bb in zip(g1, g2):
        torch.testing.assert_close(a, bb)


# ------------------------------------------------------------------------------------------
# fake-tensor peak vs. the real allocator


@pytest.mark.parametrize(
    "scheme,kw",
    [
        ("tsp", {}),
        ("tp_sp", {}),
        ("tp", {}),
        ("tp_cp", {}),
        ("tsp", {"recompute": "full"}),
        ("tsp", {"tp": 2, "cp": 2}),  # TSP x CP: K/V over the tensor-and-context group
    ],
)
def test_fake_peak_matches_real_run(scheme, kw):
    """Fake-tensor MemTracker peak vs. the CPU allocator's peak of the same step run with real
    tensors in a fresh process (profiler memory events, no tracker attached)."""
    kw = {**VALIDATE, **kw}
    fake = run_step(_cfg(scheme, fake=True, count_flops=False, **kw))
    real = fake_run.run_step_isolated(_cfg(scheme, fake=False, count_flops=False, **kw))
    assert real.real_peak_bytes > 0
    err = abs(fake.peak_bytes - real.real_peak_bytes) / real.real_peak_bytes
    assert err < 0.10, (scheme, kw, fake.peak_bytes, real.real_peak_bytes)
    assert fake.static_bytes == real.static_bytes


def _tiny_params_per_rank(tp: int) -> int:
    """TINY's parameters on one TP / TSP rank, counted by hand from the architecture (not from
    the tool): per layer the qkv (3h x h), proj (h x h), fc1 (4h x h) and fc2 (h x 4h) matrices
    sharded over ``tp``, two replicated LayerNorms (weight + bias); the embedding and the untied
    output layer (vocab 512, already a multiple of 128 x tp, sharded); the final LayerNorm; RoPE,
    no bias, no position table."""
    h, layers, vocab = 128, 2, 512
    assert vocab % (128 * tp) == 0, "vocab padding would change the count"
    per_layer = (3 * h * h + h * h + 4 * h * h + 4 * h * h) // tp + 2 * 2 * h
    return layers * per_layer + 2 * vocab * h // tp + 2 * h


def test_static_state_is_18_bytes_per_param():
    r = run_step(_cfg("tsp", count_flops=False))
    n = _tiny_params_per_rank(4)
    assert r.params_local == n
    assert r.static_bytes["Parameter"] == 2 * n
    assert r.static_bytes["Gradient"] == 4 * n  # fp32 main_grad buffer
    assert abs(r.static_bytes["Optstate"] - 12 * n) <= 16  # master + m + v (+ step scalars)
    sharded = run_step(_cfg("tsp", count_flops=False, distributed_optimizer=True, world_size=8))
    assert abs(sharded.static_bytes["Optstate"] - 6 * n) <= 16  # DP=2


# ------------------------------------------------------------------------------------------
# FLOPs


def _per_layer_gemm(cfg):
    m = cfg.model
    tok = cfg.seq * cfg.micro_batch // cfg.tp  # local tokens
    kv = m.hidden * m.groups // m.heads
    fc1_width = m.ffn_hidden * (2 if m.gated else 1)
    return {
        "qkv_fwd": 2 * tok * m.hidden * (m.hidden + 2 * kv),
        "proj_fwd": 2 * tok * m.hidden * m.hidden,
        "fc1_fwd": 2 * tok * m.hidden * fc1_width,
        "fc2_fwd": 2 * tok * m.ffn_hidden * m.hidden,
    }


def test_tsp_flops_within_documented_recompute():
    """Same run as the memory numbers: TSP may exceed TP+SP only by the recompute it is asked
    for (Megatron's flags, or its opt-ins: the per-shard fc1 GEMMs, ``attention_backward=
    "recompute"``'s attention core forward). By default (fc1 kept, saved attention backward)
    the GEMM and attention FLOPs are equal."""
    tsp = run_step(_cfg("tsp"))
    tpsp = run_step(_cfg("tp_sp"))
    g = _per_layer_gemm(_cfg("tsp"))
    extra_gemm = tsp.flops["matmul"] - tpsp.flops["matmul"]
    extra_attn = tsp.flops["attention"] - tpsp.flops["attention"]
    assert extra_gemm == 0, (extra_gemm, g)
    assert 0 <= extra_attn <= tpsp.flops["attention"] / 3.5 * (1 + 1e-9)  # one core forward
    assert tsp.flops["other"] == tpsp.flops["other"] == 0


def test_baselines_do_the_same_gemm_work():
    """TP, TP+SP and TPxCP split the same model over 4 ranks: identical per-rank FLOPs."""
    flops = {s: run_step(_cfg(s)).flops for s in ("tp", "tp_sp", "tp_cp")}
    assert flops["tp"] == flops["tp_sp"] == flops["tp_cp"]


# ------------------------------------------------------------------------------------------
# CLI


def test_cli_smoke(tmp_path, capsys):
    out = tmp_path / "mem.json"
    rc = memory_main(
        [
            "--model",
            "tiny",
            "--scheme",
            "tsp",
            "--tp",
            "2",
            "--world-size",
            "2",
            "--seq",
            "512",
            "--json",
            str(out),
        ]
    )
    assert rc == 0
    text = capsys.readouterr().out
    assert "TSP D=2" in text and "peak" in text
    data = json.loads(out.read_text())
    assert data[0]["peak_bytes"] > 0
    assert set(data[0]["peak_breakdown"]) >= {"Parameter", "Gradient", "Optstate", "Activation"}
    assert data[0]["comm"]["recv_bytes_forward"] > 0


@pytest.mark.parametrize("scheme", ["tsp", "hybrid"])
def test_cli_prints_no_megatron_notice_and_no_deprecated_collective(scheme, caplog):
    """The layers' MLP is TSPMLP in both schemes: megatron-core 0.16 would log "Unknown MLP
    type" per layer, and the collectives under torch 2.13 have deprecated old names."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        rc = memory_main(
            [
                "--model",
                "tiny",
                "--scheme",
                scheme,
                "--tp",
                "2",
                "--world-size",
                "2",
                "--seq",
                "256",
                "--no-flops",
            ]
        )
    assert rc == 0
    notices = [r.getMessage() for r in caplog.records if "Unknown MLP type" in r.getMessage()]
    assert notices == []
    deprecations = [
        f"{w.filename}:{w.lineno}: {w.message}"
        for w in caught
        if issubclass(w.category, (DeprecationWarning, FutureWarning))
    ]
    ours = [w for w in deprecations if "megatron_tsp" in w or "torch.distributed" in w]
    assert ours == [], ours


def test_cli_fewer_kv_heads_than_d(tmp_path):
    """``megatron-tsp memory --num-query-groups 1`` at D=4 (K/V head shared by all ranks, the
    megatron-core TP layout) runs, and the bytes its counter saw equal the closed form: per layer
    ``formulas.tsp_layer_comm`` (one K/V gather per head group) plus ``formulas.head_comm``."""
    from megatron_tsp.tools.estimator import formulas as fm
    from megatron_tsp.tools.estimator import planner as pl

    out = tmp_path / "mem.json"
    args = ["--model", "tiny", "--scheme", "tsp", "--tp", "4", "--world-size", "4"]
    args += ["--seq", "256", "--num-query-groups", "1", "--no-flops", "--json", str(out)]
    assert memory_main(args) == 0
    comm = json.loads(out.read_text())[0]["comm"]
    model = dataclasses.replace(pl.load_model("tiny"), query_groups=1)
    shape = fm.LayerShape.of(model, 1, 256)
    layer, head = fm.tsp_layer_comm(shape, 4), fm.head_comm(shape, 4)
    for phase, counted in (("fwd", "recv_bytes_forward"), ("bwd", "recv_bytes_backward")):
        expected = model.num_layers * (layer[f"attn_{phase}"] + layer[f"mlp_{phase}"])
        assert comm[counted] == pytest.approx(expected + head[phase], rel=1e-12), phase


def test_cli_validate(capsys):
    rc = memory_main(
        [
            "--model",
            "small",
            "--scheme",
            "tp_sp",
            "--tp",
            "2",
            "--world-size",
            "2",
            "--seq",
            "1024",
            "--validate",
            "--no-flops",
            "--no-comm",
        ]
    )
    assert rc == 0
    assert "OK" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------
# full scale


@pytest.mark.slow
def test_full_scale_7b_128k_d8():
    """One rank of 7B / S=128k / D=8, bf16, no activation recompute (~3 min).

    The default TSP layer (saved attention, per-shard fc1 outputs kept: no recompute at all, the
    FLOPs of TP+SP) needs far less than Megatron TP=8 + SP (101.4 GB): measured 72.6 GB. With
    TSP's opt-in fc1 recompute it is below the 58.7 GB measured before the attention output was
    saved once (55.3 GB), and with the attention recomputed too it keeps only layer inputs and
    stays at or below the paper's 38.8 GB (38.1 GB)."""
    full = dict(
        model=load_model("7b"), world_size=8, tp=8, seq=131072, count_flops=False, count_comm=False
    )
    tsp = run_step(RunConfig(scheme="tsp", **full))
    n = tsp.params_local
    assert n == pytest.approx(6.711e9 / 8, rel=0.01)
    assert tsp.static_bytes["Parameter"] == 2 * n
    assert tsp.static_bytes["Gradient"] == 4 * n
    assert abs(tsp.static_bytes["Optstate"] - 12 * n) <= 64
    tpsp = run_step(RunConfig(scheme="tp_sp", **full))
    assert 45e9 < tsp.peak_bytes < 0.75 * tpsp.peak_bytes, (tsp.peak_bytes, tpsp.peak_bytes)
    rec_fc1 = run_step(RunConfig(scheme="tsp", tsp_mlp_recompute_activation=True, **full))
    assert rec_fc1.peak_bytes < 58.7e9, rec_fc1.peak_bytes
    assert rec_fc1.peak_bytes < tsp.peak_bytes
    lean = run_step(
        RunConfig(
            scheme="tsp",
            tsp_attention_backward="recompute",
            tsp_mlp_recompute_activation=True,
            **full,
        )
    )
    assert 0.9 * 38.8e9 <= lean.peak_bytes <= 38.8e9, lean.peak_bytes
    assert lean.peak_bytes < rec_fc1.peak_bytes
