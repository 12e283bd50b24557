"""The traffic benchmark (``megatron_tsp.tools.traffic``, ``megatron-tsp bench --traffic``).

* the counting rule on hand-computable ops (CPU tensors under the recorder): a GEMM reads
  (m k + k n) and writes m n elements, an in-place add reads both operands and writes its
  destination (the destination counts twice), ``out=`` and overwriting destinations are not read,
  broadcast inputs count their distinct elements, views are neither kernels nor bytes;
* one tiny layer of TSP and of TP+SP recorded on shape-only CUDA tensors in a fresh interpreter
  (the CUDA stand-in): the GEMMs' launches, bytes and FLOPs equal the values computed from the
  layer's shapes, and the totals equal the sums of the recorded ops.
Counts are deterministic; nothing here is timed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import pytest
import torch

from megatron_tsp.tools import cuda_standin, traffic

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BF16 = 2


def _record(fn):
    rec = traffic.make_recorder(device_type="cpu")
    with rec:
        fn()
    return rec.records


def _only(records, name):
    rs = [r for r in records if r.name == name]
    assert len(rs) == 1, [r.name for r in records]
    return rs[0]


def test_gemm_bytes_and_flops():
    m, k, n = 6, 5, 7
    a = torch.randn(m, k, dtype=torch.bfloat16)
    b = torch.randn(k, n, dtype=torch.bfloat16)
    r = _only(_record(lambda: a @ b), "mm")
    assert r.kind == "kernel"
    assert (r.read, r.written) == ((m * k + k * n) * BF16, m * n * BF16)
    assert r.flops == 2 * m * n * k and r.flop_kind == "gemm"
    # addmm with an fp32 accumulator input: the accumulator is read too
    acc = torch.zeros(m, n)
    r = _only(_record(lambda: torch.addmm(acc, a.float(), b.float())), "addmm")
    assert (r.read, r.written) == ((m * n + m * k + k * n) * 4, m * n * 4)
    assert r.flops == 2 * m * n * k


def test_accumulating_into_the_out_tensor_reads_it():
    """``addmm(acc, a, b, out=acc)`` (an in-place accumulation written with ``out=``) reads acc as
    its ``self`` input and writes it; only the ``out=`` slot itself is not a read."""
    m, k, n = 6, 5, 7
    a, b, acc = torch.randn(m, k), torch.randn(k, n), torch.randn(m, n)
    r = _only(_record(lambda: torch.addmm(acc, a, b, out=acc)), "addmm")
    assert (r.read, r.written) == ((m * n + m * k + k * n) * 4, m * n * 4)
    fresh = torch.empty(m, n)
    r = _only(_record(lambda: torch.addmm(acc, a, b, out=fresh)), "addmm")
    assert (r.read, r.written) == ((m * n + m * k + k * n) * 4, m * n * 4)
    r = _only(_record(lambda: torch.mm(a, b, out=fresh)), "mm")
    assert (r.read, r.written) == ((m * k + k * n) * 4, m * n * 4)


def test_inplace_counts_read_and_write_out_does_not_read():
    x, y = torch.randn(4, 8), torch.randn(4, 8)
    r = _only(_record(lambda: x.add_(y)), "add_")
    assert (r.read, r.written) == (2 * 32 * 4, 32 * 4)  # x read and written, y read
    out = torch.empty(4, 8)
    r = _only(_record(lambda: torch.add(x, y, out=out)), "add")
    assert (r.read, r.written) == (2 * 32 * 4, 32 * 4)  # out= is written only
    r = _only(_record(lambda: x.copy_(y)), "copy_")
    assert (r.read, r.written) == (32 * 4, 32 * 4)  # copy_ overwrites: its destination unread


def test_views_broadcast_and_gathers():
    x = torch.randn(4, 8)
    records = _record(lambda: x.t().narrow(1, 0, 2).unsqueeze(0).expand(3, 8, 2))
    assert len(records) == 4 and all(r.kind == "view" and r.bytes == 0 for r in records)
    # reshaping a transposed tensor is no view: a copy kernel
    r = _only(_record(lambda: x.t().reshape(32)), "clone")
    assert r.kind == "kernel" and (r.read, r.written) == (32 * 4, 32 * 4)
    row = torch.randn(1, 8)
    r = _only(_record(lambda: x * row.expand(4, 8)), "mul")
    assert r.read == (32 + 8) * 4  # the broadcast row is read once
    idx = torch.tensor([0, 2])
    r = _only(_record(lambda: x.index_select(0, idx)), "index_select")
    assert (r.read, r.written) == (16 * 4 + 2 * 8, 16 * 4)


def test_standin_refuses_after_torch_import():
    if cuda_standin.loaded():
        pytest.skip("stand-in already loaded in this process")
    with pytest.raises(cuda_standin.StandinUnavailable, match="before torch is imported"):
        cuda_standin.load()


# --------------------------------------------------------------------------------------------
# one tiny layer, both schemes, in a fresh interpreter

H, HEADS, FFN, SEQ, D = 64, 4, 256, 64, 2


def tiny_model_file(tmp_path_factory, prefix: str) -> str:
    """The tiny model the traffic tests record (a GELU MLP without biases, LayerNorm, RoPE), as a
    model file; skips where the CUDA stand-in cannot be built (no C++ compiler)."""
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        pytest.skip(f"no C++ compiler ({compiler}) to build the CUDA stand-in")
    path = tmp_path_factory.mktemp(prefix) / "tiny.json"
    model = dict(
        name="tiny",
        hidden=H,
        num_layers=1,
        heads=HEADS,
        ffn=FFN,
        vocab=128,
        gated=False,
        bias=False,
        normalization="LayerNorm",
        rope=True,
    )
    path.write_text(json.dumps(model))
    return str(path)


def _record_tiny_layer(tmp_path_factory, world_size, seq=SEQ, **options):
    """One tiny layer of both schemes recorded in a fresh interpreter; ``options``: more
    ``TrafficConfig`` fields."""
    path = tiny_model_file(tmp_path_factory, f"traffic{world_size}_{seq}_")
    cfg = traffic.TrafficConfig(model=path, seq=seq, world_size=world_size, top=100, **options)
    return traffic.measure_isolated(cfg, timeout=600)


@pytest.fixture(scope="module")
def layer(tmp_path_factory):
    return _record_tiny_layer(tmp_path_factory, D)


def _gemms(summary):
    return [r for r in summary["records"] if r["flop_kind"] == "gemm"]


def test_layer_totals_are_sums_of_ops(layer):
    for scheme in ("tsp", "tp_sp"):
        s = layer[scheme]
        kernels = [r for r in s["records"] if r["kind"] == "kernel"]
        assert s["kernels"] == len(kernels) > 0
        assert s["bytes"] == sum(r["read"] + r["written"] for r in kernels) > 0
        assert s["bytes_read"] == sum(r["read"] for r in kernels)
        # an upload counts its device bytes on its record, apart from the step's
        rest = [r for r in s["records"] if r["kind"] not in ("kernel", "cached_upload", "per_step")]
        assert all(r["read"] == r["written"] == 0 for r in rest)
        ph = s["by_phase"]
        assert ph["forward"]["kernels"] + ph["backward"]["kernels"] == s["kernels"]
        assert ph["forward"]["bytes"] + ph["backward"]["bytes"] == s["bytes"]
        assert sum(e["bytes"] for e in s["top_ops"]) == s["bytes"]  # top=100: every op
        assert sum(e["launches"] for e in s["top_sources"]) == s["kernels"]
        assert s["collectives"] > 0  # the layers communicate (as no-ops)


def test_layer_gemm_flops_are_two_tokens_params(layer):
    params = H * 3 * H // D + H * H // D + 2 * H * FFN // D  # qkv, proj, fc1, fc2 per rank
    for scheme in ("tsp", "tp_sp"):
        s = layer[scheme]
        assert sum(s["linear_params_per_rank"].values()) == params
        assert s["by_phase"]["forward"]["gemm_flops"] == 2 * SEQ * params
        check = traffic.gemm_check(s)
        assert check["forward_exact"] and check["backward_recompute"] is not None
    assert layer["tp_sp"]["by_phase"]["backward"]["gemm_flops"] == 4 * SEQ * params


def test_tpsp_gemm_launches_and_bytes(layer):
    """Megatron's TP+SP layer: 4 GEMMs forward, a dgrad and a wgrad each backward, on the
    all-gathered sequence; bytes = (m k + k n + m n) x 2 per GEMM."""
    s, h = SEQ, H
    shapes = [(s, h, 3 * h // D), (s, h // D, h), (s, h, FFN // D), (s, FFN // D, h)]  # m, k, n
    expected = 0
    for m, k, n in shapes:
        expected += (m * k + k * n + m * n) * BF16  # forward y = x W^T
        expected += (m * n + n * k + m * k) * BF16  # dgrad dx = dy W
        expected += (n * m + m * k + n * k) * BF16  # wgrad dW = dy^T x
    gemms = _gemms(layer["tp_sp"])
    assert len(gemms) == 12
    assert sum(r["read"] + r["written"] for r in gemms) == expected


def test_host_ops_are_not_kernels():
    """The layers build index tables on the CPU: with CUDA as the device those are host work."""
    rec = traffic.make_recorder(device_type="cuda")
    with rec:
        torch.arange(8) + 1
    assert [r.kind for r in rec.records] == ["host", "host"]
    assert all(r.bytes == 0 for r in rec.records)


def test_upload_counts_device_bytes_only():
    """An upload reads host memory (PCIe), writes device memory: only the write is counted
    (``meta`` stands for the device here)."""
    rec = traffic.make_recorder(device_type="meta")
    x = torch.ones(4, 8)
    with rec:
        x.to("meta")
    r = _only(rec.records, "_to_copy")
    assert r.kind == "kernel" and (r.read, r.written) == (0, 32 * 4)


def test_tsp_rope_launches(layer):
    """TSP's RoPE on CUDA: each application (q and k of each of the D head groups, forward, and
    its inverse rotation in backward) is one launch of TSP's kernel (``rope_kernel``: the
    ``megatron_tsp.rope`` op); none comes from the unfused path, from Megatron's unfused RoPE or
    from autograd re-running it. The tables are built once (the first layer of a step), by
    ``rope._build``, counted apart as per-step work."""
    records = [r for r in layer["tsp"]["records"] if r["kind"] == "kernel"]
    by_source = {}
    for r in records:
        by_source[r["source"]] = by_source.get(r["source"], 0) + 1
    rope = [r for r in records if r["name"] == "rope"]
    assert len(rope) == by_source.get("rope_kernel.rope_into") == 2 * 2 * D, by_source
    assert "rope.rotate" not in by_source, by_source
    assert not [s for s in by_source if s.startswith("rope_utils.")], by_source
    assert "rope._build" not in by_source  # per step, counted apart
    per_step = [r for r in layer["tsp"]["records"] if r["kind"] == "per_step"]
    assert 0 < len(per_step) == layer["tsp"]["per_step_kernels"] <= 12
    assert {r["source"] for r in per_step} == set(traffic.PER_STEP_SOURCES)


def test_tsp_kv_grad_row_sums(layer):
    """Each head group's dK and dV land in the reduce-scatter's send buffer in one launch each
    of TSP's row-sum kernel (``row_sum_kernel``: the ``megatron_tsp.sum_rows`` op), which reads
    the flash backward's per-block dK / dV once and writes the buffer once; none of the torch
    path's per-range copies, adds or zeroing (``layout.sum_row_pieces``). The recorded rank is
    rank 0 of the fake group."""
    from megatron_tsp.core.layout import TSPLayout

    records = [r for r in layer["tsp"]["records"] if r["kind"] == "kernel"]
    sums = [r for r in records if r["name"] == "sum_rows"]
    sources = {r["source"] for r in sums}
    assert len(sums) == 2 * D and sources == {"row_sum_kernel.sum_rows_into"}, sources
    assert not [r for r in records if r["source"] == "layout.sum_row_pieces"]
    row = (HEADS // D) * (H // HEADS) * 2  # one token's K (or V) of one head group, bf16
    keys = sum(block.key_len for block in TSPLayout(D, SEQ, 0).gathered_blocks)
    assert all(r["written"] == SEQ * row and r["read"] == keys * row for r in sums), sums


def test_cached_index_table_uploads_are_not_step_kernels(layer):
    """The layout's index tables are uploaded on first use and cached on a GPU (never under
    FakeTensorMode): the recording counts those uploads apart, none as a kernel of the step."""
    s = layer["tsp"]
    uploads = [r for r in s["records"] if r["kind"] == "cached_upload"]
    assert s["cached_uploads"] == len(uploads) > 0
    assert all(r["source"] in traffic.CACHED_UPLOAD_SOURCES for r in uploads)
    kernels = [r for r in s["records"] if r["kind"] == "kernel"]
    assert not [r for r in kernels if r["source"] in traffic.CACHED_UPLOAD_SOURCES]


@pytest.fixture(scope="module")
def layer_d4(tmp_path_factory):
    """The tiny layer at D = 4 (a ring long enough for an accumulator to be added onto)."""
    return _record_tiny_layer(tmp_path_factory, 4)


def test_tsp_backward_sums_inside_its_gemms(layer_d4):
    """Where TSP's backward sums partial products, the GEMMs do it: the MLP ring's weight-
    gradient accumulator is added onto in place by the weight-gradient GEMMs of every step after
    its first (one fp32 ``add_`` in all: the drain onto the rank's own shard), and the MLP's and
    the attention's input gradients are one dgrad GEMM each, over every shard / head group (no
    in-place sums onto grad_x)."""
    d = 4
    backward = [
        r for r in layer_d4["tsp"]["records"] if r["kind"] == "kernel" and r["phase"] == "backward"
    ]
    adds = [r["source"] for r in backward if r["name"] in ("add_", "add")]
    assert adds.count("weight_ring.backward") == 1, adds
    in_place_dgrad = [r["source"] for r in backward if r["name"] == "addmm_"]
    assert in_place_dgrad == [], in_place_dgrad
    # the weight-gradient GEMMs onto the arrived accumulator: fc1 and fc2 at steps 2 .. D-1,
    # each reading the fp32 accumulator it writes (``addmm`` with the accumulator as out=)
    shard = FFN // d * H * 4  # one fp32 weight-gradient block of the shard
    onto = [
        r
        for r in backward
        if r["name"] == "addmm" and r["source"] == "precision.matmul_acc" and r["written"] == shard
    ]
    assert len(onto) == 2 * (d - 2), [(r["name"], r["source"], r["written"]) for r in backward]


def test_tsp_mlp_activation_backward_one_launch_per_shard(layer_d4):
    """The MLP's activation recomputed and differentiated in one launch per shard (TSP's
    activation kernel, ``megatron_tsp.mlp_act_backward``): it reads the shard's fc1 output and the
    activation's gradient once and writes the activation output and d(fc1 output) once (no
    autograd re-run of the activation, no copy into the one dgrad GEMM's operand)."""
    d = 4
    backward = [
        r for r in layer_d4["tsp"]["records"] if r["kind"] == "kernel" and r["phase"] == "backward"
    ]
    acts = [r for r in backward if r["name"] == "mlp_act_backward"]
    one = SEQ // d * FFN // d * BF16  # one shard's [local tokens, ffn / D] in bf16
    assert len(acts) == d and all(r["read"] == 2 * one and r["written"] == 2 * one for r in acts)
    assert not [r for r in backward if r["name"] in ("gelu", "gelu_backward")], backward


def test_bytes_are_affine_in_the_length_and_tsp_stays_above_its_floor(tmp_path_factory, layer_d4):
    """The report's split of the bytes into a length-independent part and a part per token
    (``traffic.length_split``) rests on the counts being affine in the sequence length: at three
    lengths the two differences are equal, in total and for every source. TSP's length-
    independent part is at least its floor (``traffic.tsp_weight_floor``: every weight shard read
    twice, a partial gradient of each written in fp32), and the report shows both."""
    d = 4
    results = {SEQ: layer_d4}
    for seq in (2 * SEQ, 3 * SEQ):
        results[seq] = _record_tiny_layer(tmp_path_factory, d, seq)
    # a fourth length, outside the three: the fit of the shortest and the longest is exact there
    fourth = {5 * SEQ: _record_tiny_layer(tmp_path_factory, d, 5 * SEQ)}
    for scheme in ("tsp", "tp_sp"):
        off = traffic.affine_check(results, scheme, checks=fourth)
        assert off == {2 * SEQ: 0, 5 * SEQ: 0}, (scheme, off)
        split = traffic.length_split(results, scheme)
        assert split["fixed"] + split["per_token"] * 5 * SEQ == fourth[5 * SEQ][scheme]["bytes"]
    for scheme in ("tsp", "tp_sp"):
        at = [results[q][scheme] for q in (SEQ, 2 * SEQ, 3 * SEQ)]
        assert at[2]["bytes"] - at[1]["bytes"] == at[1]["bytes"] - at[0]["bytes"] > 0
        for src in set().union(*(r["bytes_by_source"] for r in at)):
            b = [r["bytes_by_source"].get(src, 0) for r in at]
            assert b[2] - b[1] == b[1] - b[0], (scheme, src, b)
        split = traffic.length_split(results, scheme)
        assert split["fixed"] + split["per_token"] * 2 * SEQ == at[1]["bytes"]
        assert sum(split["by_source"].values()) == pytest.approx(split["fixed"])
    params = H * 3 * H // d + H * H // d + 2 * H * FFN // d  # qkv, proj, fc1, fc2 per rank
    floor = traffic.tsp_weight_floor(layer_d4["tsp"], d, "bf16")
    assert floor == d * params * (2 * BF16 + 4)
    tsp, tp_sp = traffic.length_split(results, "tsp"), traffic.length_split(results, "tp_sp")
    assert tsp["fixed"] >= floor > tp_sp["fixed"] > 0
    cfg = traffic.TrafficConfig(model="tiny", seq=SEQ, world_size=d)
    text = traffic.render(results, cfg, "bench --traffic", checks=fourth)
    assert f"({floor / traffic.GB:.2f} GB)" in text and "independent of the length" in text
    assert "checked at 128, 320: measured = fitted" in text
    ratio = tsp["per_token"] / tp_sp["per_token"]
    assert f"{tsp['per_token']:,.0f} B ({ratio:.3f}×) | {tp_sp['per_token']:,.0f} B |" in text
    # one scheme alone: its own split, no floor
    one = traffic.render(results, dataclasses.replace(cfg, schemes=["tp_sp"]), "bench --traffic")
    assert f"| {tp_sp['per_token']:,.0f} B |" in one and "floor" not in one


# --------------------------------------------------------------------------------------------
# TP+SP's RoPE: Megatron's fused path (TE's kernel stood in), or its unfused RoPE


@pytest.fixture(scope="module")
def layer_unfused_rope(tmp_path_factory):
    """The tiny TP+SP layer recorded with Megatron's unfused RoPE (``--unfused-rope``)."""
    return _record_tiny_layer(tmp_path_factory, D, schemes=["tp_sp"], rope_fusion=False)


def _kernels(summary, phase=None):
    return [
        r
        for r in summary["records"]
        if r["kind"] == "kernel" and (phase is None or r["phase"] == phase)
    ]


def test_tpsp_fused_rope_one_launch_per_tensor_and_direction(layer):
    """By default TP+SP's RoPE is Megatron's fused path: one stand-in launch for q and one for k
    forward, and one each for the inverse rotation backward, none of Megatron's unfused RoPE
    ops. Each reads its tensor (q or k of the rank's heads over the whole sequence, bf16) and the
    fp32 angles of the sequence ([S, 1, 1, head dim]) once and writes its result once."""
    s = layer["tp_sp"]
    fused = [r for r in _kernels(s) if r["name"] in traffic.FUSED_ROPE_OPS]
    assert [(r["name"], r["phase"]) for r in fused] == [
        ("fused_rope", "forward"),
        ("fused_rope", "forward"),
        ("fused_rope_backward", "backward"),
        ("fused_rope_backward", "backward"),
    ], fused
    assert {r["source"] for r in fused if r["phase"] == "forward"} == {
        "rope_utils.apply_rotary_pos_emb"
    }
    # Megatron's RoPE issues the two forward launches and nothing else
    rope = [r for r in _kernels(s) if r["source"].startswith("rope_utils.")]
    assert rope == [r for r in fused if r["phase"] == "forward"], rope
    head_dim = H // HEADS
    tensor = SEQ * (HEADS // D) * head_dim * BF16  # q (or k: no fewer K/V heads here)
    angles = SEQ * head_dim * 4
    for r in fused:
        assert (r["read"], r["written"]) == (tensor + angles, tensor), r
    assert s["top_ops"] and sum(e["launches"] for e in s["top_ops"]) == s["kernels"]


def test_tpsp_unfused_rope_under_the_flag(layer, layer_unfused_rope):
    """``--unfused-rope``: Megatron's unfused RoPE ops (``rope_utils``: cos, sin, casts,
    rotate-half, products, and their autograd backward) instead of the four fused launches; the
    rest of the layer issues the same kernels. Counts from the two recordings."""
    fused, unfused = layer["tp_sp"], layer_unfused_rope["tp_sp"]
    assert not [r for r in _kernels(unfused) if r["name"] in traffic.FUSED_ROPE_OPS]
    rope_fwd = [r for r in _kernels(unfused, "forward") if r["source"].startswith("rope_utils.")]
    assert len(rope_fwd) > 2  # more than one launch per tensor

    def names(summary, phase, drop):
        return [r["name"] for r in _kernels(summary, phase) if not drop(r)]

    # forward: the same kernels once RoPE's are left out of either
    assert names(fused, "forward", lambda r: r["name"] == "fused_rope") == names(
        unfused, "forward", lambda r: r["source"].startswith("rope_utils.")
    )
    # backward: the unfused one issues the fused one's kernels plus RoPE's autograd ops
    rest = names(fused, "backward", lambda r: r["name"] == "fused_rope_backward")
    it = iter(names(unfused, "backward", lambda r: False))
    assert all(name in it for name in rest)  # a subsequence
    extra_bwd = len(_kernels(unfused, "backward")) - len(rest)
    assert extra_bwd > 2
    assert unfused["kernels"] == fused["kernels"] - 4 + len(rope_fwd) + extra_bwd
    assert unfused["bytes"] > fused["bytes"]


def test_fused_rope_standin_is_the_rotation():
    """The stand-in computes what Megatron's unfused RoPE computes (fp32 here, where both round
    alike), and its backward is the transpose: one op each way under the recorder."""
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

    fn = traffic.fused_rope_standin()
    s, b, h, d = 6, 1, 2, 8
    t = torch.randn(s, b, h, d, requires_grad=True)
    freqs = torch.randn(s + 2, 1, 1, d // 2).repeat(1, 1, 1, 2)  # the table may be longer
    want = _apply_rotary_pos_emb_bshd(t, freqs[:s], rotary_interleaved=False)
    grad = torch.randn_like(want)
    (want_grad,) = torch.autograd.grad(want, t, grad)
    records = []

    def run():
        out = fn(t, freqs)
        (g,) = torch.autograd.grad(out, t, grad)
        records.append((out, g))

    recs = [r for r in _record(run) if r.kind == "kernel"]
    out, g = records[0]
    torch.testing.assert_close(out, want)
    torch.testing.assert_close(g, want_grad)
    assert [r.name for r in recs] == list(traffic.FUSED_ROPE_OPS), [r.name for r in recs]
    one, table = s * b * h * d * 4, s * d * 4
    assert all((r.read, r.written) == (one + table, one) for r in recs)


# --------------------------------------------------------------------------------------------
# the flash-tiles view


def test_flash_tile_rereads_by_hand():
    """A causal attention (CPU flash kernel: top-left alignment) of L = 8 queries and keys,
    head dims 2, bf16, recorded forward and backward; tiles Br = 3 query rows, Bc = 2 keys.
    Forward: the query tiles [0, 2], [3, 5], [6, 7] see 3, 6 and 8 keys, read in whole key
    tiles 4, 6 and 8: 18 K + V rows of (2 + 2) x 2 bytes = 144, less K + V read once (64): 80.
    Backward: the key tiles starting at 0, 2, 4, 6 are first seen by rows 0, 2, 4, 6, in the
    query tiles starting at 0, 0, 3, 6: 8 + 8 + 5 + 2 = 23 Q + dO rows = 184, less 64: 120.
    Without the causal mask: 3 query tiles x 8 keys = 192 - 64 = 128 forward."""
    q, k, v = (torch.randn(1, 1, 8, 2, dtype=torch.bfloat16, requires_grad=True) for _ in "qkv")

    def run(causal):
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
        out.backward(torch.ones_like(out))

    recs = _record(lambda: run(True))
    att = [r for r in recs if r.attention]
    assert [r.phase for r in att] == ["forward", "backward"], [r.name for r in recs]
    view = traffic.summarize(recs, flash_tiles=(3, 2))["flash_tiles"]
    assert (view["forward"], view["backward"], view["rereads"]) == (80, 120, 200)
    assert traffic.flash_tile_rereads(att[0].attention, 8, 8) == 0  # one tile: read once
    recs = _record(lambda: run(False))
    fwd = next(r for r in recs if r.attention and r.phase == "forward")
    assert traffic.flash_tile_rereads(fwd.attention, 3, 2) == 128


def test_flash_tiles_report(layer):
    """``--flash-tiles``: the report shows each scheme's bytes under the per-call rule, its tile
    re-reads and their sum; the per-call rule's table is unchanged."""
    results = {SEQ: layer}
    cfg = traffic.TrafficConfig(model="tiny", seq=SEQ, world_size=D, flash_tiles=[16, 16])
    plain = traffic.render(results, cfg, "bench --traffic")
    text = traffic.render(results, cfg, "bench --traffic --flash-tiles 16,16", flash_tiles=True)
    assert "Flash-tiles view (Br = 16 query rows, Bc = 16 keys" in text
    assert "Flash-tiles" not in plain
    assert text.startswith(traffic.rope_line(cfg)) and "fused path" in text.splitlines()[0]
