"""``scripts/gpu_check.py --cpu-smoke``: the GPU check's code path at tiny shapes on CPU (fake
process group, D=2). Checks the files it writes (the attention-backend table checked before
timing included, te_fused through the TE 2.15 contract emulator); timings are only checked to be
positive.
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
            "--te-emulator",
            "2.15",
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
    # the attention backends were checked before timing, and the timed one is a verified one
    bk = report["attention_backends"]
    assert set(bk["checked"]) == {"cpu_flash", "te_fused", "sdpa_recompute"}
    for name, r in bk["checked"].items():
        assert r["error"] is None and r["verified"], (name, r)
        keys = {"out", "dq", "dk", "dv"} | ({"lse"} if name != "sdpa_recompute" else set())
        assert {k for k, e in r["errors"].items() if e is not None} == keys
        assert all(0 < e < bk["tolerance"] for e in r["errors"].values() if e is not None)
    assert bk["timed"] == bk["default"] == "cpu_flash"
    assert timing["tsp"]["attention_kernel"] == "cpu_flash"
    assert (
        "## attention backends, checked before timing" in md and "Timed with: **cpu_flash**" in md
    )
    for name in bk["checked"]:
        assert f"| {name} |" in md


def test_backend_check_rejects_a_wrong_backend_and_pins_a_verified_one(monkeypatch):
    """The pre-timing check (``megatron_tsp/tools/kernel_check.py``) on the previous te_fused
    call, through the TE emulator: on 2.8 its errors are far over tolerance (not verified), on
    2.15 its TypeError is recorded; the pin then skips it, and with nothing verified it refuses.
    """
    import megatron.core  # noqa: F401  (probes for TE at first import: before the emulator)
    import pytest
    import torch

    from megatron_tsp.core.layers import kernels
    from megatron_tsp.tools import kernel_check
    from tests.emulators import transformer_engine_emulator as te_emu
    from tests.test_kernels import OldTeFusedKernel

    monkeypatch.setitem(kernels._BACKENDS, "te_fused", OldTeFusedKernel)
    case = dict(size=2, rank=1, chunk=8, head_dim=16, batch=2)
    with te_emu.install("2.8"):
        report = kernel_check.verify_backends("cpu", torch.bfloat16, ["te_fused"], **case)
    old = report["checked"]["te_fused"]
    assert not old["verified"] and old["error"] is None
    assert max(old["errors"].values()) > 0.1, old["errors"]
    with te_emu.install("2.15"):
        report = kernel_check.verify_backends(
            "cpu", torch.bfloat16, ["cpu_flash", "te_fused"], **case
        )
    assert report["checked"]["te_fused"]["error"].startswith("TypeError")
    assert report["checked"]["cpu_flash"]["verified"]
    assert kernel_check.pin_backend(report, "te_fused") == "cpu_flash"
    del report["checked"]["cpu_flash"]
    with pytest.raises(RuntimeError, match="no attention backend passed"):
        kernel_check.pin_backend(report, "te_fused")
