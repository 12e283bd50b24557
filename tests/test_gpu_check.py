"""``scripts/gpu_check.py --cpu-smoke``: the GPU check's code path at tiny shapes on CPU (fake
process group, D=2). Checks the files it writes; timings are only checked to be positive.
Runtime: about 15-60 s (one subprocess)."""

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_gpu_check_cpu_smoke_writes_report(tmp_path):
    env = dict(
        os.environ,
        PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
        OMP_NUM_THREADS="1",
        TORCHDYNAMO_DISABLE="1",
    )
    proc = subprocess.run(
        [
            sys.executable,
            os.path.join(REPO, "scripts", "gpu_check.py"),
            "--cpu-smoke",
            "--out-dir",
            str(tmp_path),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    md = (tmp_path / "gpu_check.md").read_text()
    assert report["setup"]["mode"] == "cpu-smoke" and report["setup"]["d"] == 2
    timing = report["timing"]
    for scheme in ("tsp", "tpsp"):
        r = timing[scheme]
        assert len(r["step_s"]) >= 1 and all(t > 0 for t in r["step_s"])
        assert r["kernels_per_layer_step"] > 0
        assert r["fake_peak_bytes"] > 0
        assert r["max_memory_allocated_bytes"] is None  # CPU: no CUDA allocator
    # TSP holds 1/D of the weights like TP=D: same parameter count per rank
    assert timing["tsp"]["layer_params"] == timing["tpsp"]["layer_params"]
    assert (
        timing["ratio_tsp_over_tpsp"]
        == timing["tsp"]["step_s_median"] / timing["tpsp"]["step_s_median"]
    )
    prec = report["precision"]["d1"]
    assert {
        "output",
        "grad:input",
        "grad:mlp.linear_fc1.weight",
        "grad:self_attention.linear_qkv.weight",
    } <= set(prec)
    # bf16 vs fp32: errors at bf16 resolution (2^-8), neither zero nor garbage
    for name, err in prec.items():
        assert 1e-5 < err < 5e-2, (name, err)
    for text in ("## (a)", "## (b)", "| TSP |", "| Megatron TP+SP |", "TSP / TP+SP step time"):
        assert text in md
