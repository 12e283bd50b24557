"""Quiet by default (``megatron_tsp/console/quiet.py``): the tools fold the warnings known to be
harmless (megatron-core's notices of absent Transformer Engine / apex, torch deprecations met by
Megatron's own code) into one line, ``--verbose`` shows them, and every other warning, the same
message from another module included, is printed as Python prints it."""

import os
import subprocess
import sys
import warnings

from megatron_tsp.console import quiet

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _issue(module, message, category=UserWarning, via=None):
    """Issue ``message`` from code of ``module`` (a file under its package path); ``via``: the
    module whose function calls it (the caller of a torch function)."""
    path = os.path.join("/site", *module.split(".")) + ".py"
    code = compile(f"def f():\n    warnings.warn({message!r}, C)\n", path, "exec")
    scope = {"__name__": module, "warnings": warnings, "C": category}
    exec(code, scope)
    issue = scope["f"]
    if via is None:
        return issue()
    outer = {"__name__": via, "inner": issue}
    exec(
        compile("def g():\n    inner()\n", os.path.join("/site", *via.split(".")) + ".py", "exec"),
        outer,
    )
    return outer["g"]()


PLANTED = [
    # (issuer, message, category, caller, hidden)
    (
        "megatron.core.optimizer",
        "Transformer Engine and Apex are not installed. Falling back",
        UserWarning,
        None,
        True,
    ),
    (
        "megatron.core.models.gpt.gpt_layer_specs",
        "Apex is not installed. Falling back to Torch Norm",
        UserWarning,
        None,
        True,
    ),
    (
        "torch.distributed.c10d_logger",
        "`torch.distributed.all_gather_into_tensor` is deprecated",
        FutureWarning,
        "megatron.core.tensor_parallel.mappings",
        True,
    ),
    # the same texts from other modules, and other warnings of Megatron's: shown
    (
        "megatron_tsp.core.comm",
        "Apex is not installed. Falling back to Torch Norm",
        UserWarning,
        None,
        False,
    ),
    (
        "torch.distributed.c10d_logger",
        "`torch.distributed.all_gather_into_tensor` is deprecated",
        FutureWarning,
        "megatron_tsp.core.comm",
        False,
    ),
    (
        "megatron.core.transformer.transformer_config",
        "fp8 recipe X is unsupported, using Y",
        UserWarning,
        None,
        False,
    ),
    (
        "megatron.training.arguments",
        "--foo is deprecated, use --bar",
        DeprecationWarning,
        None,
        False,
    ),
    ("some.library", "Transformer Engine is not installed", UserWarning, None, False),
]


def _plant(verbose, capsys):
    with warnings.catch_warnings(record=True) as shown:
        warnings.simplefilter("always")
        with quiet.Session(verbose):
            for issuer, message, category, caller, _ in PLANTED:
                _issue(issuer, message, category, caller)
    return [str(w.message) for w in shown], capsys.readouterr().err


def test_known_harmless_warnings_fold_into_one_line(capsys):
    previous = warnings.showwarning
    shown, err = _plant(False, capsys)
    expect = [m for _, m, _, _, hidden in PLANTED if not hidden]
    assert shown == expect
    n = sum(hidden for *_, hidden in PLANTED)
    assert (
        err.strip()
        == quiet.summary_line(n)
        == (f"megatron-tsp: {n} library warnings hidden (megatron-tsp --verbose CMD shows them)")
    )
    assert warnings.showwarning is previous and quiet.ENV not in os.environ  # restored


def test_verbose_shows_every_warning(capsys):
    shown, err = _plant(True, capsys)
    assert shown == [m for _, m, *_ in PLANTED]
    assert "hidden" not in err


def _demo(*pre):
    cmd = [sys.executable, "-m", "megatron_tsp.tools.cli", *pre, "demo", "--world-size", "2"]
    cmd += ["--tsp", "2", "--steps", "1", "--seq-length", "16", "--hidden-size", "16"]
    cmd += ["--num-attention-heads", "2", "--num-query-groups", "2", "--ffn-hidden-size", "32"]
    env = {k: v for k, v in os.environ.items() if k != quiet.ENV}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO, env.get("PYTHONPATH")) if p)
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_demo_is_quiet_and_verbose_shows_the_hidden_warnings():
    """A real command whose spawned ranks import megatron-core: no warning printed, one summary
    line counting the ranks' warnings too; ``--verbose`` prints exactly that many."""
    quiet_run = _demo()
    out = quiet_run.stdout + quiet_run.stderr
    assert "Warning" not in out, out
    lines = [x for x in quiet_run.stderr.splitlines() if "library warnings hidden" in x]
    assert len(lines) == 1, quiet_run.stderr
    n = int(lines[0].split()[1])
    loud = _demo("--verbose")
    shown = [x for x in loud.stderr.splitlines() if "Warning: " in x]
    assert len(shown) == n and n >= 4, (n, loud.stderr)
    assert "hidden" not in loud.stderr
