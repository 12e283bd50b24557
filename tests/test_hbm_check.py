"""``scripts/hbm_check.py``: the HBM-bytes check's step at tiny shapes on CPU (no profiler) for
both schemes, then its report over ncu CSVs written here in ncu's long ``--csv`` format (one row
per kernel and metric, ``==PROF==`` lines before the header, units as ncu prints them). The
report's totals must be the sums of those rows and its model bytes the step's own count.
Runtime: about 20 s (two subprocesses)."""

import csv
import io
import json
import os
import random
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(REPO, "scripts"))

import hbm_check  # noqa: E402

HEADER = [
    "ID", "Process ID", "Process Name", "Host Name", "Kernel Name", "Context", "Stream",
    "Block Size", "Grid Size", "Device", "CC", "Section Name", "Metric Name", "Metric Unit",
    "Metric Value",
]  # fmt: skip


def _ncu_csv(path, kernels):
    """kernels: [(name, read bytes, written bytes, ns)]; units as ncu 2025.3 printed them on an
    H200 (byte, ns), one scaled (Kbyte) as other ncu settings print."""
    buf = io.StringIO()
    buf.write("==PROF== Connected to process 1 (python3)\n")
    w = csv.writer(buf, quoting=csv.QUOTE_ALL, lineterminator="\n")
    w.writerow(HEADER)
    for i, (name, rd, wr, ns) in enumerate(kernels):
        for metric, unit, value in (
            ("dram__bytes_read.sum", "byte", f"{rd:,}"),
            ("dram__bytes_write.sum", "Kbyte", f"{wr / 1e3:.3f}"),
            ("gpu__time_duration.sum", "ns", f"{ns:,}"),
        ):
            w.writerow([i, 1, "python3", "h", name, 1, 7, "(128, 1, 1)", "(8, 1, 1)", 0, "9.0",
                        "Command line profiler metrics", metric, unit, value])  # fmt: skip
    with open(path, "w") as f:
        f.write(buf.getvalue())


@pytest.fixture(scope="module")
def steps(tmp_path_factory):
    out = tmp_path_factory.mktemp("hbm")
    env = dict(os.environ, PYTHONPATH=REPO, OMP_NUM_THREADS="1", TORCHDYNAMO_DISABLE="1")
    for scheme in ("tsp", "tp_sp"):
        r = subprocess.run(
            [sys.executable, os.path.join(REPO, "scripts", "hbm_check.py"), "step",
             "--cpu-smoke", "--scheme", scheme, "--out", str(out)],  # fmt: skip
            cwd=REPO, env=env, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return out


def test_step_counts_the_layer(steps):
    for scheme in ("tsp", "tp_sp"):
        with open(steps / f"counted_{scheme}.json") as f:
            c = json.load(f)
        assert c["device"] == "cpu" and c["d"] == 2 and c["seq"] == 64
        assert c["counted"]["kernels"] > 0 and c["counted"]["bytes"] > 0
        # the counted step is a whole forward + backward with its GEMMs
        assert c["counted"]["by_phase"]["backward"]["gemm_flops"] == pytest.approx(
            2 * c["counted"]["by_phase"]["forward"]["gemm_flops"], rel=0.51
        )
    with open(steps / "counted_tsp.json") as f:
        assert json.load(f)["attention_kernel"]


def test_report_sums_ncu_rows(steps):
    rng = random.Random()
    seed = rng.randrange(1 << 30)
    rng.seed(seed)
    rows = {}
    for scheme in ("tsp", "tp_sp"):
        rows[scheme] = [
            (f"kernel_{rng.randrange(4)}", rng.randrange(1, 10**9), 1000 * rng.randrange(1, 10**6),
             rng.randrange(1, 10**6))
            for _ in range(rng.randrange(3, 40))
        ]  # fmt: skip
        _ncu_csv(steps / f"ncu_{scheme}.csv", rows[scheme])
    result = hbm_check.report(str(steps))
    for scheme in ("tsp", "tp_sp"):
        s = result["schemes"][scheme]
        with open(steps / f"counted_{scheme}.json") as f:
            counted = json.load(f)["counted"]
        dram = sum(r[1] + r[2] for r in rows[scheme])
        assert s["kernels_measured"] == len(rows[scheme]), seed
        assert s["dram_bytes"] == pytest.approx(dram, rel=1e-12), seed
        assert s["kernel_time_s"] == pytest.approx(sum(r[3] for r in rows[scheme]) * 1e-9), seed
        assert s["model_bytes"] == counted["bytes"]
        assert s["dram_over_model"] == pytest.approx(dram / counted["bytes"]), seed
        assert sum(k["launches"] for k in s["top_kernels"]) == len(rows[scheme]), seed
    assert result["tsp_over_tp_sp"]["dram_bytes"] == pytest.approx(
        result["schemes"]["tsp"]["dram_bytes"] / result["schemes"]["tp_sp"]["dram_bytes"]
    )
    md = (steps / "hbm_check.md").read_text()
    assert "DRAM / model" in md and "kernel_" in md


def test_report_refuses_unknown_units(tmp_path):
    _ncu_csv(tmp_path / "x.csv", [("k", 1, 1000, 1)])
    text = (tmp_path / "x.csv").read_text().replace('"Kbyte"', '"furlong"')
    (tmp_path / "x.csv").write_text(text)
    with pytest.raises(ValueError, match="furlong"):
        hbm_check.parse_ncu_csv(str(tmp_path / "x.csv"))
