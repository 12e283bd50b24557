"""Checks of declared patches (``patches.Patch`` rows) against what is installed and against
Megatron-LM's source.

``check_installed``: every megatron-core / torch target importable here, with the parameters
its patch relies on; ``check_tree``: every Megatron-LM target in a checkout's source, read with
``ast`` (no import: its module-level imports resolved by hand, ``_source_definition``);
``check_everywhere`` both (what ``--tsp-dry-run`` reports for a launch's patches, and
``megatron-tsp check-patches``, ``megatron_tsp.tools.patch_table``, for every applier's).
"""

from __future__ import annotations

import inspect
from typing import List, Optional, Sequence, Tuple

from megatron_tsp.megatron_lm.patches import (
    STAND_IN_MODULE,
    Patch,
    megatron_version,
    resolve,
    unpatched,
)

# ------------------------------------------------------------------------------------------------
# checking the declared targets against the installed packages


def parameter_names(fn) -> Optional[Tuple[str, ...]]:
    try:
        return tuple(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None


def signature_problem(patch: Patch, names: Optional[Sequence[str]]) -> Optional[str]:
    """Why ``names`` (the target's parameters) do not hold ``patch.params`` in order, or None."""
    if patch.params is None:
        return None
    if names is None:
        return f"{patch.target}: no signature to check {patch.params} against"
    remaining = iter(names)
    if all(any(n == want for n in remaining) for want in patch.params):
        return None
    return (
        f"{patch.target} ({patch.mode}): expected parameters {list(patch.params)} in this "
        f"order, found {list(names)}"
    )


def check_installed(patches: Sequence[Patch]) -> List[str]:
    """Problems of ``patches`` against what is importable here (megatron-core, torch; the
    Megatron-LM targets are checked against the trees' source by the tests). Empty: all fine."""
    version = megatron_version()
    problems = []
    for patch in patches:
        if patch.owner_kind == "megatron-lm" or patch.module == STAND_IN_MODULE:
            continue
        present_expected = patch.owner_kind != "megatron-core" or version in patch.versions
        try:
            owner, attr = resolve(patch.target)
            target = unpatched(getattr(owner, attr))
        except (ImportError, AttributeError):
            if present_expected and not patch.optional:
                problems.append(
                    f"{patch.target} ({patch.mode}): missing in the installed "
                    f"{patch.owner_kind} (megatron-core {version})"
                )
            continue
        if not present_expected:
            problems.append(
                f"{patch.target} ({patch.mode}): exists in megatron-core {version}, "
                f"registry says only {patch.versions}"
            )
        if patch.params is not None:
            problem = signature_problem(patch, parameter_names(target))
            if problem:
                problems.append(problem)
    return problems


# ------------------------------------------------------------------------------------------------
# checking the declared targets against a Megatron-LM tree's source (no import: ``ast``)


def _module_file(tree: str, module: str) -> Optional[str]:
    import os

    base = os.path.join(tree, *module.split("."))
    for candidate in (base + ".py", os.path.join(base, "__init__.py")):
        if os.path.isfile(candidate):
            return candidate
    return None


def _bindings(statements, found: dict) -> dict:
    """Top-level names of a module (inside ``if`` / ``try`` / ``with`` blocks too): first
    binding wins, a ``def`` or ``class`` over an assignment."""
    import ast

    for node in statements:
        names = []
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names = [(node.name, node)]
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names = [((a.asname or a.name).split(".")[0], (node, a)) for a in node.names]
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = [(t.id, node) for t in targets if isinstance(t, ast.Name)]
        for name, value in names:
            is_def = isinstance(value, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
            if name not in found or (
                is_def
                and not isinstance(
                    found[name], (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
                )
            ):
                found[name] = value
        for block in ("body", "orelse", "finalbody"):
            if isinstance(node, (ast.If, ast.Try, ast.With)) and getattr(node, block, None):
                _bindings(getattr(node, block), found)
        for handler in getattr(node, "handlers", []) if isinstance(node, ast.Try) else []:
            _bindings(handler.body, found)
    return found


def _source_definition(tree: str, module: str, path: Sequence[str], depth: int = 0):
    """``("def", FunctionDef)``, ``("class", ClassDef)``, ``("value", None)`` or
    ``("external", module)`` for ``module:path`` in the tree's source; None when absent."""
    import ast

    filename = _module_file(tree, module)
    if filename is None or depth > 8:
        return None
    with open(filename) as f:
        bound = _bindings(ast.parse(f.read()).body, {}).get(path[0])
    if isinstance(bound, (ast.FunctionDef, ast.AsyncFunctionDef)):
        return ("def", bound) if len(path) == 1 else None
    if isinstance(bound, ast.ClassDef):
        if len(path) == 1:
            return ("class", bound)
        members = _bindings(bound.body, {})
        member = members.get(path[1])
        if isinstance(member, (ast.FunctionDef, ast.AsyncFunctionDef)):
            return ("def", member)
        return None if member is None else ("value", None)
    if isinstance(bound, tuple):  # an import
        node, alias = bound
        if isinstance(node, ast.Import):
            return ("external", alias.name)
        source = node.module or ""
        if node.level:
            package = module if filename.endswith("__init__.py") else module.rpartition(".")[0]
            for _ in range(node.level - 1):
                package = package.rpartition(".")[0]
            source = f"{package}.{source}" if source else package
        if _module_file(tree, source) is None:
            submodule = f"{source}.{alias.name}"
            if _module_file(tree, submodule) is not None:
                return ("value", None)  # a module
            return ("external", source)
        return _source_definition(tree, source, (alias.name, *path[1:]), depth + 1)
    return None if bound is None else ("value", None)


def _def_parameters(node) -> Tuple[str, ...]:
    a = node.args
    names = [x.arg for x in a.posonlyargs + a.args]
    names += [a.vararg.arg] if a.vararg else []
    names += [x.arg for x in a.kwonlyargs]
    names += [a.kwarg.arg] if a.kwarg else []
    return tuple(names)


def tree_version(tree: str) -> Optional[str]:
    """``"0.16"`` / ``"0.19"`` from a Megatron-LM tree's ``megatron/core/package_info.py``."""
    import os
    import re

    try:
        with open(os.path.join(tree, "megatron", "core", "package_info.py")) as f:
            text = f.read()
    except OSError:
        return None
    major = re.search(r"^MAJOR\s*=\s*(\d+)", text, re.M)
    minor = re.search(r"^MINOR\s*=\s*(\d+)", text, re.M)
    return f"{major.group(1)}.{minor.group(1)}" if major and minor else None


def check_tree(tree: str, patches: Sequence[Patch]) -> List[str]:
    """Problems of the Megatron targets of ``patches`` against a Megatron-LM tree's source
    (``megatron/training``, ``megatron/core``): each exists exactly in the versions its row lists,
    with the parameters it relies on. Empty: all fine."""
    version = tree_version(tree)
    if version is None:
        return [f"{tree}: no megatron/core/package_info.py (not a Megatron-LM tree)"]
    problems = []
    for patch in patches:
        if patch.owner_kind not in ("megatron-lm", "megatron-core"):
            continue
        label = f"{patch.target} ({patch.mode}, core_v{version} tree)"
        if patch.module == STAND_IN_MODULE:
            name = ".".join(patch.attr_path)
            found = ("module", None) if _module_file(tree, name) else None
        else:
            found = _source_definition(tree, patch.module, patch.attr_path)
        expected = version in patch.versions
        if found is None:
            if expected and not patch.optional:
                problems.append(f"{label}: missing")
            continue
        if not expected:
            problems.append(f"{label}: present, the registry says only {patch.versions}")
            continue
        kind, node = found
        if patch.params is None:
            continue
        if kind == "module":
            missing = [n for n in patch.params if _source_definition(tree, name, (n,)) is None]
            if missing:
                problems.append(f"{label}: the module lacks {missing}")
        elif kind == "def":
            problem = signature_problem(patch, _def_parameters(node))
            if problem:
                problems.append(f"{problem} (core_v{version} tree)")
        elif kind == "class":
            problems.append(f"{label}: a class; expected a function with {patch.params}")
        # "value" / "external": bound to an object defined elsewhere (torch): checked installed
    return problems


def imported_megatron_lm_tree() -> Optional[str]:
    """The Megatron-LM checkout whose ``megatron.training`` this process imports (None: none)."""
    import os

    package = _imported_from("megatron.training")  # <tree>/megatron/training
    tree = os.path.dirname(os.path.dirname(package)) if package else None
    return tree if tree and tree_version(tree) else None


def _imported_from(module: str) -> Optional[str]:
    """The folder ``module`` is imported from (None: not importable); imports only its parents."""
    import importlib.util
    import os

    try:
        spec = importlib.util.find_spec(module)
    except ImportError:
        return None
    if spec is None or not spec.origin:
        return None
    return os.path.dirname(os.path.abspath(spec.origin))


def check_everywhere(trees: Sequence[str], patches: Sequence[Patch]) -> Tuple[List[str], List[str]]:
    """``(checked, problems)``: every target of ``patches`` against the installed megatron-core
    and torch and against the source of each Megatron-LM tree in ``trees``; ``checked`` names
    where."""
    import importlib.metadata

    core_folder = _imported_from("megatron.core") or "not importable"
    checked = [
        f"megatron-core {megatron_version()} ({core_folder}) and torch "
        f"{importlib.metadata.version('torch')} (as imported here)"
    ]
    problems = check_installed(patches)
    for tree in trees:
        checked.append(f"Megatron-LM tree {tree} (core_v{tree_version(tree)})")
        problems += check_tree(tree, patches)
    return checked, problems
