"""``scripts/gpu_check.py --cpu-smoke``: the GPU check's code path at tiny shapes on CPU (fake
process group). Checks the files it writes, with every option of the script: the defaults (D=2,
fake-tensor prediction, te_fused through the TE 2.15 contract emulator) and ``--skip-fake --d 4
--seq 32 --iters 1 --warmup 0 --te-emulator 2.8``; the attention-backend table checked before
timing; timings are only checked to be positive. FSDP x CP's rank (TP = 1, CP = D: whole weights
on S/D tokens, attention over the gathered K/V) is timed beside TSP and TP+SP. Memory: each
scheme's step peak minus what was allocated before it, TSP's persistent communication buffers
counted in TSP's step and absent from TP+SP's and FSDP x CP's (on CPU the fake-tensor tool's
tracker on the real tensors stands in for the CUDA allocator).
Runtime: about 1-2 min (three subprocesses)."""

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _run(out_dir, *argv):
    env = dict(
        os.environ,
        PYTHONPATH=REPO + os.pathsep + os.environ.get("PYTHONPATH", ""),
        OMP_NUM_THREADS="1",
        TORCHDYNAMO_DISABLE="1",
    )
    return subprocess.run(
        [sys.executable, os.path.join(REPO, "scripts", "gpu_check.py"), "--cpu-smoke"]
        + ["--out-dir", str(out_dir), *argv],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def _check_memory(timing, fake):
    for scheme in ("tsp", "tp_sp", "fsdp_cp"):
        r = timing[scheme]
        assert r["memory_measured_by"] == "MemTracker (CPU smoke)"
        # baseline (parameters, input, RoPE table) recorded; the step's figure excludes it
        assert r["memory_before_step_bytes"] > 0
        assert (
            r["step_peak_bytes"] == r["max_memory_allocated_bytes"] - r["memory_before_step_bytes"]
        )
        assert r["step_peak_bytes"] > 0
        # no persistent buffer left over from the previous scheme (or run) when the step starts
        assert r["workspace_bytes_at_step_start"] == 0, (scheme, r)
        if fake:
            # the fake-tensor prediction of the same difference (same tracker, no storage)
            assert r["fake_before_step_bytes"] == r["memory_before_step_bytes"]
            predicted = r["fake_peak_bytes"] - r["fake_before_step_bytes"]
            assert abs(predicted - r["step_peak_bytes"]) <= 0.01 * r["step_peak_bytes"], r
        else:
            assert r["fake_peak_bytes"] is None and r["fake_before_step_bytes"] is None
    # TSP's workspace is allocated inside its measured step and counted there; TP+SP has none
    assert timing["tsp"]["workspace_bytes_after_step"] > 0
    assert timing["tsp"]["step_peak_bytes"] >= timing["tsp"]["workspace_bytes_after_step"]
    assert timing["tp_sp"]["workspace_bytes_after_step"] == 0
    assert timing["fsdp_cp"]["workspace_bytes_after_step"] == 0
    assert timing["tsp"]["memory_before_step_bytes"] == timing["tp_sp"]["memory_before_step_bytes"]


@pytest.mark.parametrize(
    "argv,d,seq,iters,fake",
    [
        (("--te-emulator", "2.15"), 2, 64, 2, True),
        (
            ("--skip-fake", "--d", "4", "--seq", "32", "--iters", "1", "--warmup", "0")
            + ("--te-emulator", "2.8", "--timed-backend", "sdpa_recompute", "--host-profile"),
            4,
            32,
            1,
            False,
        ),
    ],
    ids=["defaults", "every-option"],
)
def test_gpu_check_cpu_smoke_writes_report(tmp_path, argv, d, seq, iters, fake):
    proc = _run(tmp_path, *argv)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    md = (tmp_path / "gpu_check.md").read_text()
    setup = report["setup"]
    assert setup["mode"] == "cpu-smoke" and (setup["d"], setup["seq"], setup["iters"]) == (
        d,
        seq,
        iters,
    )
    timing = report["timing"]
    for scheme in ("tsp", "tp_sp", "fsdp_cp"):
        r = timing[scheme]
        assert len(r["step_s"]) == iters and all(t > 0 for t in r["step_s"])
        assert r["kernels_per_layer_step"] > 0
        assert 0 < r["kernel_busy_s"]
        profile = tmp_path / f"host_profile_{scheme}.txt"
        assert profile.exists() is ("--host-profile" in argv)
        if profile.exists():
            assert "layer_step" in profile.read_text()
    _check_memory(timing, fake)
    # TSP holds 1/D of the weights like TP=D: same parameter count per rank
    assert timing["tsp"]["layer_params"] == timing["tp_sp"]["layer_params"]
    # FSDP x CP's rank runs whole weights: D times TSP's shards, the (replicated) norms once
    norms = 2 * 2 * setup["hidden"]  # two LayerNorms, weight and bias
    assert timing["fsdp_cp"]["layer_params"] == d * (timing["tsp"]["layer_params"] - norms) + norms
    assert (
        timing["ratio_fsdp_cp_over_tsp"]
        == timing["fsdp_cp"]["step_s_median"] / timing["tsp"]["step_s_median"]
    )
    assert (
        timing["ratio_tsp_over_tp_sp"]
        == timing["tsp"]["step_s_median"] / timing["tp_sp"]["step_s_median"]
    )
    # the bf16 layer ran the verified, pinned backend; the fp32 reference its own default (the
    # pinned one may not run fp32: flash / cuDNN on the GPU)
    kernels_used = report["precision"]["attention_kernels"]
    assert kernels_used["bfloat16"] == report["attention_backends"]["timed"]
    assert kernels_used["float32"]
    prec = report["precision"]["d1"]
    # Megatron's layer against itself on the same weights: the same tensors, errors of the same
    # order (neither scheme is compared with the other's fp32 run)
    megatron = report["precision"]["megatron_d1"]["errors"]
    assert set(prec) <= set(megatron), set(prec) - set(megatron)
    for name, err in prec.items():
        assert 0.2 < err / megatron[name] < 5, (name, err, megatron[name])
    assert "| TSP / Megatron |" in md
    for scheme in ("tsp", "tp_sp", "fsdp_cp"):
        top = timing[scheme]["top_kernels_by_time"]
        assert top and sum(k["launches"] for k in top) <= timing[scheme]["kernels_per_layer_step"]
        assert sum(k["s"] for k in top) <= timing[scheme]["kernel_busy_s"] * (1 + 1e-9)
    assert {
        "output",
        "grad:input",
        "grad:mlp.linear_fc1.weight",
        "grad:self_attention.linear_qkv.weight",
    } <= set(prec)
    # bf16 vs fp32: errors at bf16 resolution (2^-8), neither zero nor garbage
    for name, err in prec.items():
        assert 1e-5 < err < 5e-2, (name, err)
    for text in ("## (a)", "## (b)", "| TSP |", "| Megatron TP+SP |", "TSP / TP+SP step time") + (
        "| FSDP x CP |",
        "FSDP x CP / TSP step time",
    ):
        assert text in md
    # TSP's Triton kernels, in Triton's interpreter here (it truncates to bf16: one ulp)
    rope, row_sum = report["rope_kernel"], report["row_sum_kernel"]
    assert rope["ran"] and row_sum["ran"] and "## (c)" in md and "## (d)" in md
    assert max(rope["errors"].values()) <= 2.0**-7, rope
    assert row_sum["ulps"]["float32"] == 0 and row_sum["ulps"]["bfloat16"] <= 1, row_sum
    assert not rope["chosen_on_this_device"] and not row_sum["chosen_on_this_device"]
    act = report["activation_kernel"]
    assert act["ran"] and "## (e)" in md and not act["chosen_on_this_device"]
    assert len(act["errors"]) == 3 * 2 * 2, act  # kinds x dtypes x (h, d)
    # fp32 within a few ulps of the value; bf16 within one rounding (the interpreter truncates)
    assert all(v < (1e-5 if "float32" in k else 2.0**-7) for k, v in act["errors"].items()), act
    assert ("skipped (--skip-fake)" in md) is not fake
    # the attention backends were checked before timing, and the timed one is a verified one
    bk = report["attention_backends"]
    assert bk["te_emulator"] == argv[argv.index("--te-emulator") + 1]
    assert set(bk["checked"]) == {"cpu_flash", "te_fused", "sdpa_recompute"}
    for name, r in bk["checked"].items():
        assert r["error"] is None and r["verified"], (name, r)
        keys = {"out", "dq", "dk", "dv"} | ({"lse"} if name != "sdpa_recompute" else set())
        assert {k for k, e in r["errors"].items() if e is not None} == keys
        assert all(0 < e < bk["tolerance"] for e in r["errors"].values() if e is not None)
    timed = argv[argv.index("--timed-backend") + 1] if "--timed-backend" in argv else "cpu_flash"
    assert bk["default"] == "cpu_flash" and bk["timed"] == timed
    assert timing["tsp"]["attention_kernel"] == timed
    assert "## attention backends, checked before timing" in md and f"Timed with: **{timed}**" in md
    for name in bk["checked"]:
        assert f"| {name} |" in md


def test_gpu_check_refuses_an_unverified_timed_backend(tmp_path):
    proc = _run(tmp_path, "--skip-fake", "--timed-backend", "cudnn")
    assert proc.returncode != 0
    assert "--timed-backend=cudnn: not verified on this machine" in proc.stderr


def test_gpu_check_refuses_a_layout_it_cannot_split(tmp_path):
    proc = _run(tmp_path, "--d", "3")
    assert proc.returncode == 2
    assert "--seq=64 is not a multiple of 2 x --d=3" in proc.stderr, proc.stderr
    assert "4 attention heads are not divisible by --d=3" in proc.stderr
    assert not (tmp_path / "gpu_check.md").exists()


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
