"""Planner: data files, analytic memory, time model, crossover, CLI smoke run."""

import json
import os
import subprocess
import sys

import pytest

from megatron_tsp.core.model_shape import ModelShape
from megatron_tsp.tools.estimator import formulas as fm
from megatron_tsp.tools.estimator import memory_model, planner_inputs, timing
from megatron_tsp.tools.estimator import planner as pl
from megatron_tsp.tools.estimator.formulas import LayerShape

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GB = 1e9


def test_shipped_profiles_load():
    assert {"7b", "llama3-8b", "tiny"} <= set(pl.available("models"))
    assert {"mi300x", "h100", "h200"} <= set(pl.available("hardware"))
    for name in pl.available("models"):
        m = pl.load_model(name)
        LayerShape.of(m, 1, 64)  # validates divisibility
    assert {"mixtral-8x7b", "deepseek-v2-lite"} <= set(pl.available("models"))  # MoE too
    for name in pl.available("hardware"):
        hw = pl.load_hardware(name)
        assert hw.peak_bf16_tflops > 0 and 0 < hw.compute_efficiency <= 1


def test_profiles_from_user_files(tmp_path):
    d = json.loads((planner_inputs.HERE / "hardware" / "h100.json").read_text())
    d["name"], d["hbm_gb"] = "mine", 1
    p = tmp_path / "mine.json"
    p.write_text(json.dumps(d))
    assert pl.load_hardware(str(p)).hbm_gb == 1
    with pytest.raises(SystemExit):
        pl.load_model("no-such-model")


def test_parameter_counts():
    # Llama 3 8B has 8,030,261,248 parameters (published model card)
    assert pl.load_model("llama3-8b").num_params() == 8_030_261_248
    h = 4096
    m = pl.load_model("7b")
    per_layer = 12 * h * h + 2 * 2 * h  # matrices + two LayerNorms (weight + bias)
    assert m.num_params() == 32 * per_layer + 2 * 32000 * h + 2 * h
    assert m.padded_vocab(8) == 32768 and m.padded_vocab(1) == 32000


def test_bandwidth_model():
    mi, h1 = pl.load_hardware("mi300x"), pl.load_hardware("h100")
    e = mi.comm_efficiency
    assert mi.bandwidth(8) == pytest.approx(7 * 64e9 * e)  # collective: all 7 links
    assert mi.bandwidth(4) == pytest.approx(3 * 64e9 * e)
    assert mi.bandwidth(8, link="p2p") == pytest.approx(64e9 * e)  # ring step: one link
    assert (
        h1.bandwidth(8, link="p2p") == h1.bandwidth(8) == pytest.approx(450e9 * h1.comm_efficiency)
    )
    # across nodes: one member per node -> one NIC share (8 x 400 Gb/s / 8 GPUs = 50 GB/s)
    assert mi.bandwidth(128, stride=8) == pytest.approx(50e9 * e)
    # eight consecutive members per node -> the node's 8 NICs, capped by the mesh
    assert mi.bandwidth(1024, stride=1) == pytest.approx(min(8 * 50e9, 7 * 64e9) * e)


def test_exposed_comm_model():
    assert timing.exposed_comm([(1.0, "critical", 1)], 10.0, 5.0) == 1.0
    assert timing.exposed_comm([(1.0, "prefetch", 8)], 10.0, 0.0) == 0.0
    assert timing.exposed_comm([(3.0, "prefetch", 1)], 2.0, 0.0) == pytest.approx(1.0)
    assert timing.exposed_comm([(8.0, "pipelined", 8)], 100.0, 0.0) == pytest.approx(1.0)
    # attention-core overlap is bounded by attention compute, the rest by what is left
    assert timing.exposed_comm(
        [(3.0, "attn_core", 1), (2.0, "async", 1)], 4.0, 1.0
    ) == pytest.approx(2.0)


def _golden_tsp_memory(seq, D, recompute):
    """7b, TSP over D on D GPUs (DP=1), B=1, default layer options: recomputed by hand."""
    h, L, V, b, heads = 4096, 32, 32000, 2, 32
    hn = h // heads
    vpad = -(-V // (128 * D)) * 128 * D
    local = L * (12 * h * h / D + 4 * h) + 2 * vpad * h / D + 2 * h
    t = seq / D  # local tokens
    # saved per layer: LN1/LN2 inputs and outputs (4h), LayerNorm mean+rstd (2 x 2 floats of
    # b bytes), saved attention: rotated q and packed k,v (3h), the output once (h), the fp32
    # log-sum-exp per head; the MLP keeps its per-shard fc1 outputs (F = 4h rows; no recompute
    # unless asked). The RoPE tables are per step.
    layer = t * (4 * h * b + 4 * b + 3 * h * b + 1 * h * b + 4 * heads + 4 * h * b)
    # freed before the attention backward: the residual, the MLP input and its stats, fc1 outs
    mlp_part = t * (2 * h * b + 2 * b + 4 * h * b)
    mlp_work = (
        t * h * b  # the layer output's gradient
        # the one dgrad GEMM: every shard's d(fc1 output) and fc1 weight, its bf16 output
        + t * 4 * h * b
        + 4 * h * h * b
        + t * h * b
        + 2 * (8 * h * h) / D * b  # the MLP weight shard read and the next in flight
        + 3 * 8 * h * h / D * 4  # three fp32 grad-accumulator shards (own + two alternating)
        # step t's activation output and its gradient; step t-1's activation output (the
        # activation kernel writes d(fc1) into the dgrad operand)
        + 3 * t * 4 * h / D * b
    )
    attn_work = (
        t * h * b  # the layer output's gradient
        + t * h * b  # grad_x, the one dgrad GEMM's bf16 output
        + t * h * b  # d(context)
        # every group's QKV gradient side by side and every shard's QKV weight: the one dgrad
        + t * 3 * h * b
        + 3 * h * h * b
        + (1 + 3) * 4 * h * h / D * b  # own attention shard + 3 stream buffers (hold 2)
        + 4 * h * h / D * 4  # fp32 weight-gradient partial of the group's shard
        # the first chunk's bf16 dK/dV (up to S/2 keys) kept while the second chunk's runs
        + (seq * h / D) * b
        # the kernel's bf16 dK/dV for the chunk whose keys span S (aten_flash: one
        # call, native GQA), before both are summed into the send buffer
        + (2 * seq * h / D) * b
    )
    # the vocabulary ring where it receives fewer bytes than Megatron's output layer (the
    # default, "auto": V h (2b + 4) <= S (3 h b + 20), i.e. from 43,656 tokens here): fp32
    # logits of the local tokens over the padded vocabulary, one shard's bf16 GEMM output, the
    # weight ring's packed shard + 2 spares; backward adds the 3 fp32 gradient-accumulator
    # shards and the bf16 dX accumulator. Megatron's: bf16 logits + their fp32 copy, the
    # gathered final hidden. Then 3 [S/D, h] tensors around the final norm, ~47 B of per-token
    # ids / losses / cross-entropy statistics
    ring = vpad * h * (2 * b + 4) <= seq * (3 * h * b + 20)
    shard = vpad / D * h
    ring_fwd = t * vpad * 4 + t * vpad / D * b + 3 * shard * b
    ring_bwd = ring_fwd + 3 * shard * 4 + t * h * b
    megatron = seq * vpad / D * (2 + 4) + seq * h * b
    head = (max(ring_fwd, ring_bwd) if ring else megatron) + 3 * t * h * b + 47 * seq
    # persistent K/V comm workspace: forward 2 gathered [S + S/(2D), 2h/D] (the gathered K/V
    # and a copy of the rank's late chunk; saved attention keeps its packed local K/V as saved
    # tensors); backward adds 2 dK/dV send [S, 2h/D] + 2 local receive buffers, allocated in
    # the first backward layer's attention
    kv_full, kv_local = 2 * seq * h / D, 2 * seq * h / D / D
    ws_fwd = 2 * (kv_full + kv_local / 2) * b
    ws_bwd = ws_fwd + 2 * (kv_full + kv_local) * b
    # Megatron's fp32 rotary frequencies [S, hn] + TSP's cos / signed-sin [S/D, hn] bf16
    tables = seq * hn * 4 + 2 * t * hn * b
    head += ws_fwd + tables
    if recompute == "full":
        # the recomputed layer (its input is the stored checkpoint) and its output, held by the
        # checkpoint's backward; the attention phase also holds the output's gradient
        rec = layer  # - the input (checkpointed) + the output (held): same bytes
        attn_work += t * h * b
        first = [rec + mlp_work + ws_fwd, rec - mlp_part + attn_work + ws_bwd]
        later = [
            rec + mlp_work + ws_bwd - t * h * b,
            rec - mlp_part + attn_work + ws_bwd - t * h * b,
        ]
        extra = max(first + later) + 3 * t * hn * b  # the recompute rebuilds the local tables
        acts = L * t * h * b
    else:
        first = [mlp_work + ws_fwd, attn_work - mlp_part + ws_bwd]
        later = [mlp_work + ws_bwd - layer, attn_work - mlp_part + ws_bwd - layer]
        extra = max(first + later)
        acts = L * layer
    # + Megatron's output layer's gathered input, kept by its global memory buffer (the
    # vocabulary ring gathers nothing)
    bwd = extra + tables + (0 if ring else seq * h * b)
    fwd_peak = head >= bwd
    return {
        "params": 2 * local,
        "grads": 4 * local,
        "optimizer": 12 * local,
        "activations": acts,
        "transient": 0.0 if fwd_peak else bwd,
        "logits": head if fwd_peak else 0.0,
    }


@pytest.mark.parametrize("seq,recompute", [(16384, "none"), (131072, "none"), (131072, "full")])
def test_analytic_memory_golden_tsp(seq, recompute):
    got = pl.analytic_memory("7b", "tsp", seq, degree=8, dp=1, recompute=recompute)
    want = _golden_tsp_memory(seq, 8, recompute)
    assert set(got) == set(want)
    for k in want:
        assert got[k] == pytest.approx(want[k]), k


def test_analytic_memory_relations():
    m, S = "7b", 131072
    tsp = pl.analytic_memory(m, "tsp", S, degree=8)
    tpsp = pl.analytic_memory(m, "tp_sp", S, degree=8)
    tp = pl.analytic_memory(m, "tp", S, degree=8)
    cp = pl.analytic_memory(m, "cp", S, degree=8)
    # same weight sharding for TSP / TP / TP+SP; CP holds all weights
    assert tsp["params"] == tpsp["params"] == tp["params"] < cp["params"] / 7
    # per-layer activations: TSP (local tokens, MLP recomputed) < TP+SP (all /D) < plain TP
    assert tsp["activations"] < tpsp["activations"] < tp["activations"]
    # TP+SP keeps 1/D of the unsharded activations except unfused RoPE's cos/sin tables, which
    # every TP rank builds for the whole sequence (4 [S, hn] bf16 per layer); CP keeps 1/D
    one = pl.analytic_memory(m, "tp", S, degree=1)
    rope = 32 * 4 * S * 128 * 2
    assert tpsp["activations"] == pytest.approx((one["activations"] - rope) / 8 + rope)
    assert cp["activations"] == pytest.approx(one["activations"] / 8)
    # full recompute keeps only layer inputs; distributed optimizer divides the optimizer by DP
    full = pl.analytic_memory(m, "tp_sp", S, degree=8, recompute="full")
    assert full["activations"] == pytest.approx(32 * S / 8 * 4096 * 2)
    sharded = pl.analytic_memory(m, "tp_sp", S, degree=8, dp=16)
    assert sharded["optimizer"] == pytest.approx(tpsp["optimizer"] / 16)
    assert (
        pl.analytic_memory(m, "tp_sp", S, degree=8, dp=16, distributed_optimizer=False)["optimizer"]
        == tpsp["optimizer"]
    )
    # memory grows with S for every strategy
    for kind in ("tsp", "tp_sp", "cp"):
        a = sum(pl.analytic_memory(m, kind, 16384, degree=8).values())
        assert a < sum(pl.analytic_memory(m, kind, S, degree=8).values())


def test_evaluate_golden_h100():
    """One configuration recomputed by hand: 7b, S=64k, 8 x H100 (DP=1), no recompute, compute
    time from FLOPs (the measured-kernel model: tests/estimator/test_measured_traffic.py)."""
    o = pl.Options(recompute="none", compute_model="flops")
    hw = pl.load_hardware("h100")
    S, h, D = 65536, 4096, 8
    flops = hw.peak_bf16_tflops * 1e12 * hw.compute_efficiency
    bw = 450e9 * hw.comm_efficiency
    gemm = 2 * S * 12 * h * h
    attn = 2 * S * S * h  # 2 GEMMs x 2 flop x causal half
    tpsp = pl.evaluate("7b", hw, pl.make_strategy("tp_sp", D), S, D, o)
    assert tpsp["layer_compute_s"]["fwd"] == pytest.approx((gemm + attn) / D / flops)
    assert tpsp["layer_compute_s"]["bwd"] == pytest.approx(2 * (gemm + attn) / D / flops)
    x = 7 / 8 * S * h * 2
    # forward collectives are all exposed; backward: only the two row-parallel grad all-gathers
    assert tpsp["layer_exposed_s"]["fwd"] == pytest.approx(4 * x / bw)
    assert tpsp["layer_exposed_s"]["bwd"] == pytest.approx(2 * x / bw)
    tsp = pl.evaluate("7b", hw, pl.make_strategy("tsp", D), S, D, o)
    # no recompute by default (attention saved, fc1 kept): TP+SP's backward FLOPs
    assert tsp["layer_compute_s"]["bwd"] == pytest.approx(2 * (gemm + attn) / D / flops)
    opt_in = pl.evaluate(
        "7b",
        hw,
        pl.make_strategy("tsp", D),
        S,
        D,
        pl.Options(recompute="none", tsp_recompute_fc1=True, compute_model="flops"),
    )
    recompute = 2 * S * 4 * h * h  # TSP's opt-in fc1 recompute (F = 4h: 4h x h)
    assert opt_in["layer_compute_s"]["bwd"] == pytest.approx(
        (2 * (gemm + attn) + recompute) / D / flops
    )
    # TSP forward: the first head group's weight broadcast (fill) and, K/V all-gathers being
    # pipelined one group ahead (what the layers do), only the first group's
    kv = 7 / 8 * 2 * S * h * 2
    bcast = 7 / 8 * 4 * h * h * 2
    assert tsp["layer_exposed_s"]["fwd"] == pytest.approx((kv / D + bcast / D) / bw)
    assert tsp["layer_comm_fwd"] == pytest.approx(7 / 8 * (12 * h * h + 2 * S * h) * 2)
    assert tsp["dp"] == 1 and tsp["dp_exposed_s"] == 0.0
    step = (
        32
        * (
            tsp["layer_compute_s"]["fwd"]
            + tsp["layer_compute_s"]["bwd"]
            + tsp["layer_exposed_s"]["fwd"]
            + tsp["layer_exposed_s"]["bwd"]
        )
        + tsp["head_s"]
        + tsp["replicated_allreduce_s"]
    )
    assert tsp["num_microbatches"] == 2**24 // S
    assert tsp["step_s"] == pytest.approx(
        tsp["num_microbatches"] * (step - tsp["replicated_allreduce_s"])
        + tsp["replicated_allreduce_s"]
    )
    assert tsp["tokens_per_s"] == pytest.approx(tsp["num_microbatches"] * S / tsp["step_s"])


def test_planner_bytes_crossover_marks_the_switch():
    o = pl.Options(compute_model="flops")
    p = pl.plan(
        "7b",
        "mi300x",
        131072,
        1024,
        8,
        [pl.make_strategy("tsp", 8), pl.make_strategy("tp_sp", 8)],
        options=o,
    )
    x = p["bytes_crossover_seq"]["fwd"]
    assert x == pytest.approx(6 * 4096)
    for seq, tsp_wins in ((int(x * 0.9), False), (int(x * 1.1), True)):
        a = pl.evaluate("7b", "mi300x", pl.make_strategy("tsp", 8), seq, 1024, o)
        b = pl.evaluate("7b", "mi300x", pl.make_strategy("tp_sp", 8), seq, 1024, o)
        assert (a["layer_comm_fwd"] <= b["layer_comm_fwd"]) == tsp_wins
    # throughput regions are consistent with point evaluations
    tsp, tpsp = pl.make_strategy("tsp", 8), pl.make_strategy("tp_sp", 8)
    for lo, hi in p["throughput_regions"]:
        mid = int(lo * 1.05) if hi is None else int((lo * hi) ** 0.5)
        assert (
            pl.evaluate("7b", "mi300x", tsp, mid, 1024, o)["tokens_per_s"]
            >= pl.evaluate("7b", "mi300x", tpsp, mid, 1024, o)["tokens_per_s"]
        )


def test_cli_dispatch_missing_module(monkeypatch, capsys):
    from megatron_tsp.tools import cli

    monkeypatch.setitem(cli.COMMANDS, "ghost", ("megatron_tsp.no_such_module_xyz", "test"))
    assert cli.main(["ghost"]) == 2
    assert "not available" in capsys.readouterr().err
    assert cli.main(["nope"]) == 2
    assert cli.main(["--help"]) == 0


def test_cli_plan_smoke(tmp_path):
    png, js = tmp_path / "plan.png", tmp_path / "plan.json"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "megatron_tsp.tools.cli",
            "plan",
            "--model",
            "7b",
            "--seq-length",
            "131072",
            "--gpus",
            "1024",
            "--hardware",
            "mi300x",
            "--plot",
            str(png),
            "--json",
            str(js),
            "--sweep",
            "16384,65536,131072",
            "--compute-model",
            "flops",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    out = r.stdout
    for needle in (
        "TSP8",
        "TP8+SP",
        "CP8",
        "TP2+SPxCP4",
        "Assumptions:",
        "B*S >= 6 h",
        "paper: B*S > 8h",
        "compute efficiency",
    ):
        assert needle in out, needle
    d = json.loads(js.read_text())
    assert [r["strategy"] for r in d["rows"]][:2] == ["TSP8", "TP8+SP"]
    assert d["sweep"]["seqs"] == [16384, 65536, 131072]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "skipped" in out
    else:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_kernel_dkv_workspace_by_backend():
    """The attention kernel's dK/dV outputs in the backward working set: one head group over the
    whole sequence for aten_flash (one bottom-right call, native GQA) and for top-left kernels
    (prefix + diagonal blocks, their dK/dV parts never joined); twice that for te_fused
    (contiguous K/V copies beside its dK/dV); kernels without native GQA
    also hold K/V repeated to the query heads and dK/dV per query head before the fold."""
    m = ModelShape(
        name="g", hidden=1024, num_layers=2, heads=16, query_groups=4, ffn=4096, vocab=1000
    )
    S, D = 8192, 4
    shape = LayerShape.of(m, 1, S)
    unit = 2 * S / D * 2  # K+V of one hidden unit over S tokens, bf16
    assert memory_model._kernel_dkv_bytes(shape, D, "aten_flash") == pytest.approx(unit * 256)
    assert memory_model._kernel_dkv_bytes(shape, D, "te_fused") == pytest.approx(2 * unit * 256)
    assert memory_model._kernel_dkv_bytes(shape, D, "cpu_flash") == pytest.approx(
        unit * 1024 + unit * (1024 + 256)
    )
    with pytest.raises(ValueError, match="attn_kernel='fa9'"):
        memory_model._kernel_dkv_bytes(shape, D, "fa9")


def test_tsp_backward_broadcast_fill_only_with_attention_recompute():
    shape = LayerShape.of(pl.load_model("7b"), 1, 131072)
    saved = {t.what: t.overlap for t in fm.tsp_layer_terms(shape, 8)}
    rec = {t.what: t.overlap for t in fm.tsp_layer_terms(shape, 8, recompute_attn=True)}
    assert saved["re-broadcast attention weight shards"] == "prefetch"
    assert rec["re-broadcast attention weight shards (first one exposed)"] == "pipelined"
    assert saved["all-gather K,V of one head group"] == "pipelined"
