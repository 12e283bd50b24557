"""Smoke tests of the benchmark (``megatron_tsp.tools.bench``).

It runs as a subprocess with tiny shapes. Structure and counted bytes are checked; timings are
only checked to be present and positive (timing ratios are reported, never asserted).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SEQS = (32, 64)
LAYERS, HIDDEN, HEADS, GROUPS, FFN = 2, 32, 4, 2, 64


def _run(cmd, timeout):
    env = dict(
        os.environ,
        PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
        OMP_NUM_THREADS="1",
    )
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def bench(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bench")
    js, md = tmp / "bench.json", tmp / "bench.md"
    cmd = [
        sys.executable,
        "-m",
        "megatron_tsp.tools.bench",
        "--world-sizes",
        "2",
        "--seq-lengths",
        ",".join(map(str, SEQS)),
        "--steps",
        "2",
        "--warmup",
        "0",
        "--num-layers",
        str(LAYERS),
        "--hidden-size",
        str(HIDDEN),
        "--num-attention-heads",
        str(HEADS),
        "--num-query-groups",
        str(GROUPS),
        "--ffn-hidden-size",
        str(FFN),
        "--style",
        "gpt2",
        "--json",
        str(js),
        "--out",
        str(md),
    ]
    proc = _run(cmd, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(js.read_text()), md.read_text(), proc.stdout


def _layer_bytes(kind, seq, d):
    """Received bytes per rank of one layer, fwd+bwd, from the closed forms (fp32)."""
    from megatron_tsp.tools.estimator import formulas as fm

    shape = fm.LayerShape(
        batch=1,
        seq=seq,
        hidden=HIDDEN,
        heads=HEADS,
        query_groups=GROUPS,
        ffn=FFN,
        gated=False,
        bias=True,
        dtype_bytes=4,
        normalization="LayerNorm",
    )
    comm = {"tsp": fm.tsp_layer_comm, "tp_sp": fm.tp_sp_layer_comm, "tp": fm.tp_layer_comm}[kind]
    return comm(shape, d), shape


def test_bench_report_structure(bench):
    report, markdown, stdout = bench
    assert report["machine"]["cpu_model"]
    assert report["machine"]["threads_per_rank"] == 1
    assert report["machine"]["torch"]
    assert len(report["load_average"]["start"]) == 3
    [group] = report["groups"]
    assert group["world_size"] == 2
    assert [r["seq_length"] for r in group["results"]] == list(SEQS)
    for res in group["results"]:
        assert set(res["variants"]) == {"tsp", "tp_sp", "tp"}
        for v in res["variants"].values():
            assert len(v["step_s"]) == 2 and all(t > 0 for t in v["step_s"])
            assert v["step_s_median"] > 0
            assert v["recv_consistent_across_steps"]
        # the three variants compute the same function from the same weights
        assert res["loss_rel_diff"] < 1e-4, res["loss_rel_diff"]
    for text in (markdown, stdout):
        assert "### D = 2" in text
        assert "| S | TSP ms | TP+SP ms | TP ms | TSP/TP+SP time | TSP/TP time |" in text
        for s in SEQS:
            assert f"\n| {s} | " in text
        assert "AMD" in text or report["machine"]["cpu_model"] in text


def test_bench_bytes_match_formulas(bench):
    report, _, _ = bench
    from megatron_tsp.tools.estimator import formulas as fm

    [group] = report["groups"]
    d = group["world_size"]
    for res in group["results"]:
        seq = res["seq_length"]
        for kind, v in res["variants"].items():
            layer, shape = _layer_bytes(kind, seq, d)
            # per (block, phase): num_layers x the per-layer closed form
            for phase in fm.PHASES:
                assert v["by_phase"][phase] == pytest.approx(LAYERS * layer[phase], rel=1e-9), (
                    kind,
                    seq,
                    phase,
                )
            sync = (
                0.0
                if kind == "tp"
                else fm.replicated_grad_allreduce(
                    shape, d, LAYERS, extra_params=2 * HIDDEN, grad_dtype_bytes=4
                )
            )
            assert v["by_phase"]["grad_sync"] == pytest.approx(sync, rel=1e-9)
            assert v["by_phase"]["other"] == 0
            expected = LAYERS * fm.total(layer) + sync
            assert v["recv_bytes_per_step"] == pytest.approx(expected, rel=1e-9)
            assert v["analytic"]["total"] == pytest.approx(expected, rel=1e-9)
            assert sum(e["recv"] for e in v["by_op"].values()) == pytest.approx(expected)
        ops = {k: set(v["by_op"]) for k, v in res["variants"].items()}
        # TSP: no all-reduce inside layers (only the replicated-grad sync); plain TP: only those
        assert res["variants"]["tsp"]["by_op"]["all_reduce"]["calls"] == 1
        assert {"broadcast", "irecv", "isend", "reduce"} <= ops["tsp"]
        assert ops["tp"] == {"all_reduce"}
        assert ops["tp_sp"] == {"all_gather_into_tensor", "reduce_scatter_tensor", "all_reduce"}


def test_bench_rejects_bad_sequence_length():
    from megatron_tsp.tools import bench

    with pytest.raises(SystemExit):
        bench.parse_args(["--world-sizes", "4", "--seq-lengths", "36"])
