"""What the long estimator tools print: ``memory --table`` one header and one line per row
(rows printed as they are measured; the header was repeated before every row), progress on
stderr; ``prefill-memory`` every row once (each was printed again in a final table). The
measurements are stubbed: these tests read only what is printed."""

import types

from megatron_tsp.tools.estimator import fake_run, inference_memory, memory


def _result(cfg):
    return types.SimpleNamespace(
        label=cfg.label,
        config=dict(
            seq=cfg.seq,
            recompute=cfg.recompute,
            scheme=cfg.scheme,
            tp=cfg.tp,
            cp=cfg.cp,
            model=dict(hidden=cfg.model.hidden),
        ),
        peak_breakdown={},
        peak_bytes=10**9,
        peak_phase="bwd",
        flops={},
        comm={},
        wall_s=1.0,
        real_peak_bytes=None,
    )


def test_memory_table_header_once_rows_once(monkeypatch, capsys):
    monkeypatch.setattr(fake_run, "run_step_isolated", _result)
    assert memory.main(["--model", "7b", "--table", "--seqs", "16384,131072"]) == 0
    out, err = capsys.readouterr()
    lines = out.splitlines()
    rows = len(memory.TABLE_LAYOUTS) * 2
    assert sum(x.startswith("layout") for x in lines) == 1, out
    assert sum(x.startswith("peak memory per rank") for x in lines) == 1, out
    body = lines[3:]  # after the title, the header and the rule
    assert len(body) == rows and len(set(body)) == rows, out
    assert all(x.split()[-1] == "1" for x in body), out  # measured rows only
    progress = [x for x in err.splitlines() if x.startswith("megatron-tsp memory: [")]
    assert len(progress) == rows and progress[-1].startswith(f"megatron-tsp memory: [{rows}/"), err


def test_memory_single_run_reports_progress(monkeypatch, capsys):
    monkeypatch.setattr(fake_run, "run_step", _result)
    assert memory.main(["--model", "7b", "--scheme", "tsp", "--tp", "8", "--seq", "4096"]) == 0
    out, err = capsys.readouterr()
    assert "one training step under fake tensors" in err and "TSP" in out.upper(), (out, err)


def test_prefill_memory_rows_once(monkeypatch, capsys):
    def peak(scheme, size, seq, model, batch, dtype):
        return dict(
            scheme=scheme,
            size=size,
            seq=seq,
            breakdown={"Parameter": 2**30},
            kv_cache=2**30,
            peak=3 * 2**30,
        )

    monkeypatch.setattr(inference_memory, "prefill_peak_isolated", peak)
    argv = ["--model", "tiny", "--size", "2", "--seqs", "2048,4096"]
    assert inference_memory.main(argv) == 0
    out, err = capsys.readouterr()
    lines = out.splitlines()
    assert sum(x.startswith("prefill") for x in lines) == 1, out
    body = lines[2:]
    assert len(body) == 6 and len(set(body)) == 6, out  # 3 schemes x 2 lengths, once each
    assert sum("prefill-memory: [" in x for x in err.splitlines()) == 6, err
