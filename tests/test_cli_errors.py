"""Bad command-line input is refused in one place, before any work (issue 35 item 1).

Every case runs ``megatron-tsp CMD ARGS`` and expects exit status 2, exactly one non-empty line
on stderr naming the flag, no traceback, and nothing started: spawning ranks or subprocesses
raises (in-process cases patch the spawn functions; subprocess cases are bounded in time).
"""

from __future__ import annotations

import contextlib
import io
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from megatron_tsp.tools import cli

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (command line, the flag the one line must name)
CASES = [
    # memory
    ("memory --tp 3", "--tp 3"),
    ("memory --seq -100", "--seq"),
    ("memory --seq 100", "--seq 100"),
    ("memory --tp 4 --world-size 6", "--world-size 6"),
    ("memory --cp 0", "--cp"),
    ("memory --world-size 0", "--world-size"),
    ("memory --micro-batch -1", "--micro-batch"),
    ("memory --hidden-size -1", "--hidden-size"),
    ("memory --num-layers 0", "--num-layers"),
    ("memory --num-attention-heads 0", "--num-attention-heads"),
    ("memory --num-query-groups x", "--num-query-groups"),
    ("memory --ffn-hidden-size 0", "--ffn-hidden-size"),
    ("memory --vocab-size 0", "--vocab-size"),
    ("memory --expert-model-parallel-size 0", "--expert-model-parallel-size"),
    ("memory --scheme fsdp_cp --tp 1 --cp 8 --world-size 8 --cp-comm-type ring", "--cp-comm-type"),
    # plan / compare / documents
    ("plan --documents bogus --seq-length 131072 --gpus 8", "--documents"),
    ("compare --gpus 7", "--gpus"),
    ("compare --seq-lengths 0", "--seq-lengths"),
    ("documents --documents bogus --seq-length 131072 --degree 8", "--documents"),
    ("documents --documents uniform:1k-32k --seq-length 100 --degree 8", "--seq-length: 100"),
    ("memory --tolerance -1", "--tolerance"),
    ("memory --table --seqs 0,5", "--seqs"),
    ("memory --model nope", "--model nope"),
    # demo
    ("demo --tsp 3 --world-size 3", "--tensor-sequence-parallel-size=3"),
    ("demo --world-size 3 --tsp 2", "--world-size 3"),
    ("demo --steps -1", "--steps"),
    ("demo --seq-length 100", "--seq-length=100"),
    ("demo --seq-length 0", "--seq-length"),
    ("demo --micro-batch-size 0", "--micro-batch-size"),
    ("demo --num-layers 0", "--num-layers"),
    ("demo --hidden-size 0", "--hidden-size"),
    ("demo --num-attention-heads 0", "--num-attention-heads"),
    ("demo --num-query-groups 0", "--num-query-groups"),
    ("demo --ffn-hidden-size 0", "--ffn-hidden-size"),
    ("demo --lr 0", "--lr"),
    ("demo --seed -1", "--seed"),
    ("demo --tolerance -1", "--tolerance"),
    ("demo --world-size 0", "--world-size"),
    # generate
    ("generate --tsp 3", "--tensor-sequence-parallel-size=3"),
    ("generate --tsp 0", "--tensor-sequence-parallel-size"),
    ("generate --max-new-tokens -3", "--max-new-tokens"),
    ("generate --max-new-tokens 0", "--max-new-tokens 0"),  # 0 only with --save
    ("generate --load /nonexistent", "--load"),
    ("generate --hf /nonexistent", "--hf"),
    ("generate --random-prompt-tokens -1", "--random-prompt-tokens"),
    ("generate --temperature -1", "--temperature"),
    ("generate --top-k -1", "--top-k"),
    ("generate --top-p 2", "--top-p"),
    ("generate --seed -1", "--seed"),
    ("generate --prefill-chunk-tokens 0", "--prefill-chunk-tokens"),
    ("generate --train-steps -1", "--train-steps"),
    ("generate --rope-scaling-factor 0", "--rope-scaling-factor"),
    ("generate --rotary-seq-len-interpolation-factor -1", "--rotary-seq-len-interpolation-factor"),
    ("generate --rotary-base 0", "--rotary-base"),
    # plan
    ("plan --seq-length -5 --gpus 8", "--seq-length"),
    ("plan --hardware tpu --seq-length 8 --gpus 8", "--hardware tpu"),
    ("plan --model nope --seq-length 8 --gpus 8", "--model nope"),
    ("plan --seq-length 8 --gpus 0", "--gpus"),
    ("plan --seq-length 8 --gpus 12", "--gpus"),
    ("plan --seq-length 8 --gpus 8 --degree 0", "--degree"),
    ("plan --seq-length 8 --gpus 8 --micro-batch 0", "--micro-batch"),
    ("plan --seq-length 8 --gpus 8 --num-microbatches 0", "--num-microbatches"),
    ("plan --seq-length 8 --gpus 8 --global-batch-tokens -1", "--global-batch-tokens"),
    ("plan --seq-length 8 --gpus 8 --cp x", "--cp"),
    ("plan --seq-length 8 --gpus 8 --efficiency 2", "--efficiency"),
    ("plan --seq-length 8 --gpus 8 --comm-efficiency 0", "--comm-efficiency"),
    ("plan --seq-length 8 --gpus 8 --sweep 0", "--sweep"),
    # prefill-memory
    ("prefill-memory --size 0", "--size"),
    ("prefill-memory --seqs -1", "--seqs"),
    ("prefill-memory --batch 0", "--batch"),
    ("prefill-memory --schemes tsp,xx", "--schemes"),
    ("prefill-memory --model nope", "--model"),
    # moe
    ("moe --tsp 0", "--tsp"),
    ("moe --tsp 1", "--tsp 1"),
    ("moe --seq-lengths -5", "--seq-lengths"),
    ("moe --micro-batch 0", "--micro-batch"),
    # bench
    ("bench --world-sizes 0", "--world-sizes"),
    ("bench --world-sizes 3", "--world-sizes"),
    ("bench --seq-lengths 100", "--seq-lengths"),
    ("bench --steps 0", "--steps"),
    ("bench --warmup -1", "--warmup"),
    ("bench --num-layers 0", "--num-layers"),
    ("bench --hidden-size 0", "--hidden-size"),
    ("bench --num-attention-heads 0", "--num-attention-heads"),
    ("bench --num-query-groups 0", "--num-query-groups"),
    ("bench --ffn-hidden-size 0", "--ffn-hidden-size"),
    ("bench --micro-batch-size 0", "--micro-batch-size"),
    ("bench --threads-per-rank 0", "--threads-per-rank"),
    ("bench --seed -1", "--seed"),
    ("bench --tolerance -1", "--tolerance"),
    ("bench --timeout 0", "--timeout"),
    # bench --traffic (its own parser): checked before a recording interpreter starts
    ("bench --traffic --world-size 1", "--world-size 1"),
    ("bench --traffic --world-size 3 --seq-lengths 96", "--world-size 3"),
    ("bench --traffic --seq-lengths 100", "--seq-lengths 100"),
    ("bench --traffic --seq-lengths -4", "--seq-lengths"),
    ("bench --traffic --micro-batch-size 0", "--micro-batch-size"),
    ("bench --traffic --top -1", "--top"),
    ("bench --traffic --model nope", "--model nope"),
    ("bench --traffic --schemes tsp,foo", "--schemes"),
    ("bench --traffic --flash-tiles 128", "--flash-tiles 128"),
    ("bench --traffic --flash-tiles 0,64", "--flash-tiles"),
    ("bench --traffic --documents bogus", "--documents"),
    ("bench --traffic --documents uniform:1k-2k --schemes fsdp_cp", "--schemes fsdp_cp"),
    # check-patches
    ("check-patches --megatron-lm /nonexistent", "--megatron-lm"),
    ("check-patches --megatron-lm /tmp", "--megatron-lm"),
    # cpu-run
    ("cpu-run --nproc 0 -- x.py", "--nproc"),
    ("cpu-run --nproc 2 --timeout -1 -- x.py", "--timeout"),
]


class Started(RuntimeError):
    pass


def _refuse(*args, **kwargs):
    raise Started("a rank or subprocess was started for bad input")


@pytest.fixture
def nothing_starts(monkeypatch):
    import torch.multiprocessing as mp

    for name in ("spawn", "start_processes"):
        monkeypatch.setattr(mp, name, _refuse)
    monkeypatch.setattr(subprocess, "Popen", _refuse)
    monkeypatch.delenv("MEGATRON_TSP_DEBUG", raising=False)


@pytest.mark.parametrize("line,flag", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line_naming_the_flag(line, flag, nothing_starts):
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            rc = cli.main(line.split())
        except SystemExit as exc:
            rc = exc.code
    lines = [x for x in err.getvalue().splitlines() if x.strip()]
    words = line.split()
    cmd = " ".join(words[:2]) if words[1:2] == ["--traffic"] else words[0]  # its own parser
    assert rc == 2, (rc, lines)
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"megatron-tsp {cmd}: error: "), lines
    assert flag in lines[0], lines


def test_debug_shows_the_traceback(nothing_starts, monkeypatch):
    monkeypatch.setenv("MEGATRON_TSP_DEBUG", "")
    with pytest.raises(ValueError, match="--tensor-sequence-parallel-size=3"):
        with contextlib.redirect_stderr(io.StringIO()):
            cli.main(["--debug", "demo", "--tsp", "3", "--world-size", "3"])
    monkeypatch.delenv("MEGATRON_TSP_DEBUG")


def test_prog_names():
    from megatron_tsp.megatron_lm import cpu_runner
    from megatron_tsp.tools import demo

    for module, prog in ((demo, "megatron-tsp demo"), (cpu_runner, "megatron-tsp cpu-run")):
        out = io.StringIO()
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
            module.main(["--help"])
        assert out.getvalue().startswith(f"usage: {prog} "), out.getvalue()[:80]


# end to end, as a user runs them: one line on the real stderr (import-time warnings included)
SUBPROCESS_CASES = [
    (["-m", "megatron_tsp.tools.cli", "memory", "--tp", "3"], "--tp 3"),
    (["-m", "megatron_tsp.tools.cli", "demo", "--tsp", "3", "--world-size", "3"], "--tensor"),
    (["-m", "megatron_tsp.tools.cli", "generate", "--max-new-tokens", "-3"], "--max-new-tokens"),
    (["-m", "megatron_tsp.tools.cli", "plan", "--seq-length", "-5", "--gpus", "8"], "--seq"),
]


def _run(argv):
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, *argv], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    return proc, time.monotonic() - start


def test_end_to_end_one_line_fast():
    with ThreadPoolExecutor(len(SUBPROCESS_CASES)) as pool:
        done = list(pool.map(_run, [argv for argv, _ in SUBPROCESS_CASES]))
    for (argv, flag), (proc, seconds) in zip(SUBPROCESS_CASES, done):
        lines = [x for x in proc.stderr.splitlines() if x.strip()]
        assert proc.returncode == 2, (argv, proc.stderr[-2000:])
        assert len(lines) == 1 and flag in lines[0], (argv, lines)
        assert "Traceback" not in proc.stderr
        # imports only (a loaded 2-core machine: generous); spawning D ranks takes far longer
        assert seconds < 60, (argv, seconds)


def test_launcher_names_the_tsp_flag():
    from tests.megatron_lm.common import megatron_lm_tree, run_launcher

    tree = megatron_lm_tree("0.16")
    if tree is None:
        pytest.skip("no Megatron-LM core_v0.16 tree")
    script = os.path.join(tree, "pretrain_gpt.py")
    # TSP's own flags are checked before Megatron is imported: no import-time notice precedes
    # the one line
    for value, message in (
        ("-2", "--tensor-sequence-parallel-size must be a positive integer, got -2"),
        ("x", "argument --tensor-sequence-parallel-size: invalid int value: 'x'"),
    ):
        proc = run_launcher([script, "--tensor-sequence-parallel-size", value, "--tsp-dry-run"])
        lines = [x for x in proc.stderr.splitlines() if x.strip()]
        assert proc.returncode == 2, proc.stderr[-2000:]
        assert lines == [f"megatron_tsp: error: {message}"], proc.stderr[-2000:]
