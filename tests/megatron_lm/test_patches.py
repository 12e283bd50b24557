"""The declared patches (each applier's table, collected by megatron_tsp/tools/patch_table.py)
against the supported versions.

* every megatron-core / torch target exists, with the parameters its row relies on, in the
  installed packages (megatron-core 0.16.1 on 3.11 here; scripts/test_core_0_19.sh runs this file
  on 3.12 with megatron-core 0.19.2);
* every Megatron target (megatron.training, megatron.core) exists exactly in the trees its row
  lists, core_v0.16.1 and core_v0.19.0, read with ``ast`` (no import);
* apply then remove gives back the very same objects; applying twice changes nothing;
* a planted wrong signature or missing target fails the checks, naming the target;
* every patch an applier applies is one it declared (cpu_support, cpu_runner, the counter's own
  patching loop); a patch declared twice differently is refused; docs/megatron-lm.md shows the
  current table.
"""

from __future__ import annotations

import ast
import dataclasses
import os
import subprocess
import sys

import pytest

from megatron_tsp.megatron_lm import patch_checks as C
from megatron_tsp.megatron_lm import patches as P
from megatron_tsp.tools import patch_table as T
from tests.megatron_lm.common import REPO, megatron_lm_tree

_INSTALLED_KINDS = ("megatron-core", "torch", "python")


def _tree_or_skip(version):
    tree = megatron_lm_tree(version)
    if tree is None:
        pytest.skip(f"set MEGATRON_LM_PATH or MEGATRON_LM_PATH_0_19 to core_v{version}")
    return tree


def test_every_row_is_complete_and_unique():
    keys = [(p.mode, p.target) for p in T.all_patches()]
    assert len(keys) == len(set(keys))
    for p in T.all_patches():
        assert p.mode in P.MODES, p
        assert ":" in p.target and len(p.reason) > 8, p
        assert set(p.versions) <= set(P.MEGATRON_VERSIONS) and p.versions, p


def test_installed_targets_exist_with_their_parameters():
    import megatron.core
    import torch

    assert P.megatron_version() in P.MEGATRON_VERSIONS, megatron.core.__version__
    assert torch.__version__.startswith(P.TORCH_VERSIONS), torch.__version__
    assert C.check_installed(T.all_patches()) == []


@pytest.mark.parametrize("version", P.MEGATRON_VERSIONS)
def test_megatron_targets_exist_with_their_parameters_in_the_tree(version):
    tree = _tree_or_skip(version)
    assert C.tree_version(tree) == version
    assert C.check_tree(tree, T.all_patches()) == []


def _imported_names(path: str) -> dict:
    """{name: module} of the top-level ``from module import name`` of a script."""
    with open(path) as f:
        module = ast.parse(f.read())
    return {
        a.asname or a.name: node.module
        for node in module.body
        if isinstance(node, ast.ImportFrom)
        for a in node.names
    }


@pytest.mark.parametrize("version", P.MEGATRON_VERSIONS)
def test_pretrain_gpt_imports_the_patched_names_from_patched_modules(version):
    """The launch hooks wrap names where pretrain_gpt.py imports them from: the script must still
    import them from a module the registry patches."""
    tree = _tree_or_skip(version)
    imported = _imported_names(os.path.join(tree, "pretrain_gpt.py"))
    for name in ("get_batch_on_this_cp_rank", "pretrain"):
        patched = {
            p.module
            for p in P.of_mode(P.LAUNCH)
            if p.attr_path == (name,) and version in p.versions
        }
        assert imported.get(name) in patched, (version, name, imported.get(name), patched)


# ------------------------------------------------------------------------------------------------
# planted errors: the checks can fail, and name the target


def _planted(**changes) -> P.Patch:
    row = next(
        p for p in T.all_patches() if p.target == "megatron.core.utils:get_batch_on_this_cp_rank"
    )
    return dataclasses.replace(row, **changes)


def test_a_wrong_signature_fails_the_installed_check_naming_the_target():
    bad = _planted(params=("batch", "no_such_parameter"))
    problems = C.check_installed([bad])
    assert len(problems) == 1 and bad.target in problems[0] and "no_such_parameter" in problems[0]
    # order matters: cp_group comes after batch
    assert C.check_installed([_planted(params=("cp_group", "batch"))])


def test_a_missing_target_fails_the_installed_check_naming_the_target():
    bad = _planted(target="megatron.core.utils:get_batch_on_this_cp_rank_renamed")
    problems = C.check_installed([bad])
    assert len(problems) == 1 and "get_batch_on_this_cp_rank_renamed" in problems[0]
    torch_bad = P.Patch(P.CPU_RUNNER, "torch.cuda:no_such_function", "planted", ())
    assert "torch.cuda:no_such_function" in C.check_installed([torch_bad])[0]


@pytest.mark.parametrize("version", P.MEGATRON_VERSIONS)
def test_planted_errors_fail_the_tree_check_naming_the_target(version):
    tree = _tree_or_skip(version)
    wrong = _planted(target="megatron.training.arguments:validate_args", params=("args", "oops"))
    missing = _planted(target="megatron.training.arguments:validate_args_renamed")
    other = "0.19" if version == "0.16" else "0.16"
    stale = _planted(target="megatron.training.arguments:validate_args", versions=(other,))
    problems = C.check_tree(tree, [wrong, missing, stale])
    assert len(problems) == 3, problems
    assert "validate_args" in problems[0] and "oops" in problems[0]
    assert "validate_args_renamed" in problems[1] and "missing" in problems[1]
    assert "present" in problems[2]


@pytest.mark.parametrize("version", P.MEGATRON_VERSIONS)
def test_check_patches_command_passes_on_a_supported_tree(version, capsys):
    tree = _tree_or_skip(version)
    assert T.main(["--megatron-lm", tree]) == 0
    out = capsys.readouterr().out
    assert f"{len(T.all_patches())} declared patch targets, checked in:" in out
    assert f"Megatron-LM tree {tree} (core_v{version})" in out
    assert out.rstrip().endswith("all present, with the parameters they rely on"), out


def test_check_patches_command_fails_naming_every_missing_target(tmp_path, capsys):
    """A checkout that says core_v0.16 but holds none of the source: every Megatron target the
    registry expects there is reported missing, by name, and the command exits 1."""
    info = tmp_path / "megatron" / "core" / "package_info.py"
    info.parent.mkdir(parents=True)
    info.write_text("MAJOR = 0\nMINOR = 16\nPATCH = 1\n")
    assert T.main(["--megatron-lm", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    expected = [
        p
        for p in T.all_patches()
        if p.owner_kind in ("megatron-lm", "megatron-core")
        and "0.16" in p.versions
        and not p.optional
    ]
    assert f"{len(expected)} problem(s):" in out, out[-2000:]
    for p in expected:
        assert f"{p.target} ({p.mode}, core_v0.16 tree): missing" in out, p.target


def test_dry_run_reports_patch_problems_and_fails():
    from megatron_tsp.megatron_lm import dry_run

    problem = "megatron.training.arguments:validate_args (launch, core_v0.16 tree): missing"
    bad = {"checked": ["Megatron-LM tree /x (core_v0.16)"], "problems": [problem]}
    lines = dry_run._patch_check_lines(bad)
    assert "1 PROBLEM(S)" in lines[0]
    assert lines[1].strip() == "checked in Megatron-LM tree /x (core_v0.16)"
    assert lines[-1].strip() == problem
    assert dry_run.exit_status({"patch_check": bad}) == 1
    assert dry_run.exit_status({"patch_check": {"checked": [], "problems": []}}) == 0


def test_undeclared_patches_are_refused():
    with pytest.raises(P.UndeclaredPatchError, match="torch.cuda:is_available"):
        P.apply(P.LAUNCH, "torch.cuda:is_available", lambda: True)


def test_a_declared_target_that_is_missing_is_refused_naming_it(monkeypatch):
    row = P.Patch(P.DRY_RUN, "megatron_tsp.megatron_lm.patches:no_such_attribute", "planted", ())
    monkeypatch.setattr(P, "_DECLARED", dict(P._DECLARED))
    P.declare([row])
    with pytest.raises(P.PatchTargetMissing, match="patches:no_such_attribute"):
        P.apply(row.mode, row.target, None)
    assert not P.is_active(row.mode, row.target)


def test_a_patch_declared_twice_differently_is_refused(monkeypatch):
    monkeypatch.setattr(P, "_DECLARED", dict(P._DECLARED))
    row = next(p for p in T.all_patches() if p.mode == P.DRY_RUN)
    assert P.declare([row]) == (row,)  # the same row again: nothing changes
    with pytest.raises(ValueError, match="declared twice"):
        P.declare([dataclasses.replace(row, reason="another reason")])
    with pytest.raises(ValueError, match="unknown mode"):
        P.declare([dataclasses.replace(row, mode="no-such-mode")])


# ------------------------------------------------------------------------------------------------
# apply / remove


def _applicable_here():
    """Rows whose target is importable in this process (Megatron-LM targets need a tree)."""
    rows = []
    for p in T.all_patches():
        if p.owner_kind not in _INSTALLED_KINDS or p.module == P.STAND_IN_MODULE:
            continue
        try:
            owner, attr = P.resolve(p.target)
            getattr(owner, attr)
        except (ImportError, AttributeError):
            assert p.optional or P.megatron_version() not in p.versions, p.target
            continue
        rows.append(p)
    return rows


def test_apply_then_remove_restores_every_original_object():
    rows = _applicable_here()
    assert len(rows) > 60
    already = {(p.mode, p.target) for p in P.active()}  # e.g. CPU support on in this process
    busy = {target for _, target in already}
    before, applied = {}, []
    for p in rows:
        owner, attr = P.resolve(p.target)
        before[(p.mode, p.target)] = (owner, attr, getattr(owner, attr), attr in vars(owner))
    try:
        for p in rows:
            # one patch per target here (stacking: test_stacked_patches_of_one_target_...)
            if p.target in busy:
                continue
            busy.add(p.target)
            owner, attr, original, _ = before[(p.mode, p.target)]
            stand_in = _StandIn(p.target)
            assert P.apply(p.mode, p.target, stand_in) is original, p.target
            applied.append((p.mode, p.target))
            assert getattr(owner, attr) is stand_in, p.target
            # twice: harmless (the same original back, nothing re-wrapped)
            assert P.apply(p.mode, p.target, _StandIn("again")) is original, p.target
            assert getattr(owner, attr) is stand_in, p.target
        assert len(applied) > 60
    finally:
        for key in reversed(applied):
            P.remove(*key)
    for key, (owner, attr, original, owned) in before.items():
        assert getattr(owner, attr) is original, key
        assert (attr in vars(owner)) == owned, key
    assert {(p.mode, p.target) for p in P.active()} == already


class _StandIn:
    """A replacement that is not any object of the target's module."""

    def __init__(self, label):
        self.label = label

    def __call__(self, *args, **kwargs):
        raise AssertionError(f"stand-in for {self.label} called")


def test_stacked_patches_of_one_target_unwind_in_order():
    import torch

    target = "torch.cuda:current_device"
    # an earlier test in this process may have left CPU support on: start from the bare target
    earlier = torch.cuda.current_device if P.is_active(P.CPU_SUPPORT, target) else None
    P.remove(P.CPU_SUPPORT, target)
    original = torch.cuda.current_device
    try:
        with P.applied(P.CPU_SUPPORT, target, lambda: "cpu"):
            with P.applied(P.DRY_RUN, target, lambda: "meta"):
                assert torch.cuda.current_device() == "meta"
            assert torch.cuda.current_device() == "cpu"
        assert torch.cuda.current_device is original
    finally:
        if earlier is not None:
            P.apply(P.CPU_SUPPORT, target, earlier)


def test_instance_patch_is_deleted_again():
    from megatron.core.tensor_parallel.random import CudaRNGStatesTracker

    tracker = CudaRNGStatesTracker()
    target = "megatron.core.tensor_parallel.random:CudaRNGStatesTracker.fork"
    with P.applied(P.FAKE_RUN, target, lambda *a, **k: "forked", owner=tracker):
        assert tracker.fork() == "forked"
        assert CudaRNGStatesTracker.fork is not tracker.fork
    assert "fork" not in vars(tracker)


def test_stand_in_module_is_registered_and_removed():
    name = "fused_weight_gradient_mlp_cuda"
    if name in sys.modules:
        pytest.skip(f"{name} is imported in this process")
    target = f"{P.STAND_IN_MODULE}:{name}"
    module = type(sys)(name)
    P.apply(P.CPU_RUNNER, target, module)
    try:
        assert sys.modules[name] is module
    finally:
        P.remove(P.CPU_RUNNER, target)
    assert name not in sys.modules


def test_cpu_support_is_removable():
    import torch

    from megatron_tsp.megatron_lm import cpu_support

    if cpu_support.is_enabled():
        pytest.skip("CPU support is on in this process")
    original = torch.cuda.current_device
    cpu_support.enable_cpu_support(force=True)
    cpu_support.enable_cpu_support(force=True)
    try:
        assert torch.cuda.current_device() == torch.device("cpu")
    finally:
        cpu_support.disable_cpu_support()
    assert torch.cuda.current_device is original and not cpu_support.is_enabled()


# ------------------------------------------------------------------------------------------------
# each mode's rows are its applier's table; the counter's own patching loop is declared


def test_each_modes_rows_are_its_appliers_tables():
    from megatron_tsp.megatron_lm import batch, cpu_runner, cpu_support, dry_run, hooks, spec

    T.all_patches()  # every applier imported
    assert set(cpu_support._SHIMS) == set(P.of_mode(P.CPU_SUPPORT))
    applied_apart = {
        cpu_runner._ITERATION_RECORD,
        cpu_runner._FUSED_WEIGHT_GRADIENT_STAND_IN,
        cpu_runner._TRITON_KERNELS_STAND_IN,
    }
    answered = {a.patch for a in cpu_runner.CUDA_ANSWERS}
    assert answered | applied_apart == set(P.of_mode(P.CPU_RUNNER))
    launch = set(hooks._HOOKS) | set(batch._BATCH_HOOKS) | {spec._MODEL_HOOK}
    assert launch == set(P.of_mode(P.LAUNCH))
    assert {p.mode for p in dry_run.launch_patches()} == set(dry_run.LAUNCH_MODES)
    # the applier modules named in MODES hold the rows of their mode
    assert [m for m in P.MODES if not P.of_mode(m)] == []


def test_every_counter_patch_is_declared():
    from megatron_tsp.tools.comm_counter import CommCounter

    declared = {p.target for p in P.of_mode(P.COUNTER)}
    with CommCounter() as counter:
        patched = {f"{module.__name__}:{name}" for module, name in counter._originals}
    assert patched - declared == set(), "the counter patches undeclared targets"
    # optional rows: torch 2.13's new collective names, counted once the counter knows them
    required = {p.target for p in P.of_mode(P.COUNTER) if not p.optional}
    present = {t for t in required if P.resolve(t)[1] in vars(P.resolve(t)[0])}
    assert present - patched == set(), "declared counter targets the counter does not patch"


# ------------------------------------------------------------------------------------------------
# the dry run lists the patches; the docs show the table


def test_report_lines_name_state_mode_target_and_reason():
    target = "torch.cuda:current_device"
    with P.applied(P.DRY_RUN, target, lambda: "meta"):
        active = [line for line in P.report_lines() if target in line and "dry-run" in line]
    removed = [line for line in P.report_lines() if target in line and "dry-run" in line]
    reason = P.find(P.DRY_RUN, target).reason
    assert active == [f"active  dry-run     {target}: {reason}"]
    assert removed == [f"removed dry-run     {target}: {reason}"]


def test_docs_show_the_current_table():
    with open(os.path.join(REPO, "docs", "megatron-lm.md")) as f:
        text = f.read()
    assert T.doc_block() in text, (
        "docs/megatron-lm.md is out of date: replace the block between the patches-table markers "
        "with megatron_tsp.tools.patch_table.doc_block()"
    )
    for p in T.all_patches():
        assert f"`{p.target}`" in T.markdown_table()


def test_hooks_install_and_uninstall_restore_megatron_lm():
    """In a fresh process with the Megatron-LM tree: install() twice wraps every launch target
    present in that version once; uninstall() gives back the very same objects."""
    tree = megatron_lm_tree(P.megatron_version())
    if tree is None:
        pytest.skip("needs the Megatron-LM tree of the installed megatron-core")
    probe = r"""
import sys
from megatron_tsp.megatron_lm import hooks, patches as P
rows = [p for p in P.of_mode(P.LAUNCH)]
def snapshot():
    out = {}
    for p in rows:
        try:
            owner, attr = P.resolve(p.target)
            out[p.target] = getattr(owner, attr)
        except (ImportError, AttributeError):
            assert P.megatron_version() not in p.versions, p.target
    return out
before = snapshot()
hooks.install(); hooks.install()
during = snapshot()
for target, fn in during.items():
    assert fn is not before[target], target
    wrapped = getattr(fn, "__wrapped__", None)
    assert wrapped is before[target], (target, "wrapped twice or not at all")
hooks.uninstall()
after = snapshot()
assert all(after[t] is before[t] for t in before), [t for t in before if after[t] is not before[t]]
assert P.active() == []
print("OK", len(before))
"""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([REPO, tree]), TORCHDYNAMO_DISABLE="1")
    proc = subprocess.run(
        [sys.executable, "-c", probe],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tree,
    )
    assert proc.returncode == 0 and "OK" in proc.stdout, proc.stderr[-3000:]
