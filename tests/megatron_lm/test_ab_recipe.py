"""The README's A/B recipe on CPU, run as the README states it: the two ``megatron-tsp cpu-run``
lines of its "# A/B on CPU" block (TSP D=2, and stock TP=2 + ``--sequence-parallel``, dropout 0),
through the console entry point. Without Transformer Engine / apex the stock line runs with the
project's TP+SP spec and says so in one line; the two runs' per-iteration losses and grad norms
agree within fp32 reduction order (test_training_loop's tolerances). About 20-30 s."""

import os
import re
import shlex
import subprocess
import sys

import pytest

from megatron_tsp.console import quiet
from megatron_tsp.megatron_lm import cpu_runner
from tests.megatron_lm.common import REPO, megatron_lm_path, relative_difference

CHECKOUT = megatron_lm_path()
pytestmark = pytest.mark.skipif(
    CHECKOUT is None, reason="set MEGATRON_LM_PATH to a Megatron-LM checkout to run these"
)
README = os.path.join(REPO, "README.md")
NOTICE = "using the project's TP+SP spec (no Transformer Engine)"
FP32_LOSS_RTOL, FP32_NORM_RTOL = 1e-5, 1e-4  # tests/megatron_lm/test_training_loop.py
ROW = re.compile(r"^\s*(\d+)\s+(\S+)\s+(\S+)\s*$")


def recipe(text: str, checkout: str):
    """The argv lists of the README block that starts with ``# A/B on CPU`` (``ARGS=...`` and
    the commands using ``$ARGS`` and ``$MEGATRON_LM_PATH``)."""
    block = re.search(r"```bash\n# A/B on CPU[^\n]*\n(.*?)```", text, re.S)
    assert block, "README: no '# A/B on CPU' block"
    lines = [x.strip() for x in block.group(1).replace("\\\n", " ").splitlines() if x.strip()]
    assert lines[0].startswith("ARGS="), lines[0]
    (args,) = shlex.split(lines[0][len("ARGS=") :])
    return [
        shlex.split(x.replace("$MEGATRON_LM_PATH", checkout).replace("$ARGS", args))
        for x in lines[1:]
    ]


def _cli(argv):
    assert argv[0] == "megatron-tsp", argv
    env = {k: v for k, v in os.environ.items() if k != quiet.ENV}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_tsp.tools.cli", *argv[1:]],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = [ROW.match(x) for x in proc.stdout.splitlines()]
    table = [(int(m[1]), float(m[2]), float(m[3])) for m in rows if m]
    return proc, table


def test_readme_ab_recipe_on_cpu():
    with open(README) as f:
        tsp_cmd, stock_cmd = recipe(f.read(), CHECKOUT)
    assert "--tensor-sequence-parallel-size" in tsp_cmd and "--stock" in stock_cmd
    assert "--sequence-parallel" in stock_cmd
    for flag in ("--hidden-dropout", "--attention-dropout"):  # dropout 0 in both
        assert tsp_cmd[tsp_cmd.index(flag) + 1] == "0" == stock_cmd[stock_cmd.index(flag) + 1]
    tsp, tsp_table = _cli(tsp_cmd)
    stock, stock_table = _cli(stock_cmd)
    iterations = int(tsp_cmd[tsp_cmd.index("--train-iters") + 1])
    assert (
        [r[0] for r in tsp_table] == [r[0] for r in stock_table] == list(range(1, iterations + 1))
    ), (tsp.stdout, stock.stdout)
    for (_, loss, norm), (_, ref_loss, ref_norm) in zip(tsp_table, stock_table):
        assert relative_difference(loss, ref_loss) <= FP32_LOSS_RTOL, (tsp_table, stock_table)
        assert relative_difference(norm, ref_norm) <= FP32_NORM_RTOL, (tsp_table, stock_table)
    if cpu_runner.tp_sp_spec_needed(stock_cmd[stock_cmd.index("--") + 2 :]):
        notices = [x for x in stock.stderr.splitlines() if NOTICE in x]
        assert len(notices) == 1, stock.stderr
    assert NOTICE not in tsp.stderr
    # the summary says which loss it shows; no library warning printed
    for proc in (tsp, stock):
        assert "lm loss (this iteration)" in proc.stdout and cpu_runner.SUMMARY_NOTE in proc.stdout
        assert "Warning" not in proc.stdout + proc.stderr, proc.stderr
