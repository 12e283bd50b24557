"""Every patch megatron_tsp makes to Megatron-LM, megatron-core, torch or Python goes through here.

A *patch* replaces an attribute of a module or class that megatron_tsp does not own (a function
Megatron-LM's scripts look up by name, a CUDA-only torch call answered on CPU, ...). Each one is a
``Patch`` row: its target, why it exists, which mode applies it, the parameters of the target it
relies on (checked in the supported versions by ``tests/megatron_lm/test_patches.py``) and the
Megatron versions whose source holds it. The rows live next to the code that applies them: each
applier module builds its table with ``row`` and hands it to ``declare`` at import (``MODES``
names the appliers). Code applies a patch only through ``apply(mode, target, ...)``, which refuses
a target no applier declared, records the original object and is idempotent; ``remove`` /
``remove_mode`` put the original back (the very same object). ``--tsp-dry-run`` prints the patches
applied in its process (``report_lines``). Checking the targets against the installed packages
and the Megatron-LM trees is ``patch_checks``; every applier's rows together (``megatron-tsp
check-patches``, the table ``docs/megatron-lm.md`` shows) are ``megatron_tsp.tools.patch_table``.

Supported: megatron-core 0.16.x and 0.19.x (``MEGATRON_VERSIONS``), the Megatron-LM trees
core_v0.16.1 and core_v0.19.0, torch 2.13 (``TORCH_VERSIONS``).

Target syntax: ``"module:attr"`` or ``"module:Class.attr"``; ``"sys.modules:name"`` registers a
stand-in module under ``name`` (only when no such module is importable already).
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import sys
from typing import Callable, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

MEGATRON_VERSIONS = ("0.16", "0.19")  # megatron-core 0.16.x / 0.19.x; trees core_v0.16.1, 0.19.0
TORCH_VERSIONS = ("2.13",)

# Who applies a patch (the ``mode`` of a row).
LAUNCH = "launch"
CPU_SUPPORT = "cpu-support"
CPU_RUNNER = "cpu-runner"
DRY_RUN = "dry-run"
FAKE_RUN = "fake-run"
COUNTER = "counter"
GENERATE = "generate"

# each mode and the modules that declare and apply its rows (``megatron_tsp.tools.patch_table``
# imports them all)
MODES = {
    LAUNCH: "megatron_tsp.megatron_lm.hooks.install() (with batch and spec): the launcher, the "
    "patched pretrain_gpt.py",
    CPU_SUPPORT: "megatron_tsp.megatron_lm.cpu_support.enable_cpu_support(): every CPU run",
    CPU_RUNNER: "megatron_tsp.megatron_lm.cpu_runner.apply_cuda_answers(): pretrain_gpt.py on CPU",
    DRY_RUN: "megatron_tsp.megatron_lm.dry_run: --tsp-dry-run",
    FAKE_RUN: "megatron_tsp.tools.estimator.fake_run (with uniform_routing): the fake-tensor "
    "memory estimator",
    COUNTER: "megatron_tsp.tools.comm_counter.CommCounter: counts communication while active",
    GENERATE: "megatron_tsp.tools.generate: torch_dist checkpoint I/O on CPU",
}

STAND_IN_MODULE = "sys.modules"


@dataclasses.dataclass(frozen=True)
class Patch:
    """One replaced attribute (see the module docstring for ``target``)."""

    mode: str
    target: str
    reason: str
    # Parameters of the target the replacement relies on, in their order (other parameters may
    # sit between or after them); for a stand-in module, the functions it must provide. None:
    # not a function (a class, a C method, a value): existence is checked, not the signature.
    params: Optional[Tuple[str, ...]] = None
    # Megatron versions whose source holds a Megatron target (ignored for torch / Python ones).
    versions: Tuple[str, ...] = MEGATRON_VERSIONS
    # Skipped, not refused, where absent (torch builds without a function, optional modules).
    optional: bool = False

    @property
    def module(self) -> str:
        return self.target.split(":")[0]

    @property
    def attr_path(self) -> Tuple[str, ...]:
        return tuple(self.target.split(":")[1].split("."))

    @property
    def owner_kind(self) -> str:
        """What is patched: megatron-lm, megatron-core, torch or python."""
        name = ".".join(self.attr_path) if self.module == STAND_IN_MODULE else self.module
        if name.startswith(("megatron.training", "megatron.legacy")):
            return "megatron-lm"
        if name.startswith("megatron.core"):
            return "megatron-core"
        if name.startswith("torch"):
            return "torch"
        return "python"


def row(mode, target, reason, params=None, versions=MEGATRON_VERSIONS, optional=False) -> Patch:
    """One ``Patch`` (the parameters as a tuple), for an applier's table."""
    return Patch(
        mode, target, reason, None if params is None else tuple(params), tuple(versions), optional
    )


DEVICE_PARAM = ("device",)  # what torch.cuda's per-device queries take

_DECLARED: Dict[Tuple[str, str], Patch] = {}


def declare(rows: Iterable[Patch]) -> Tuple[Patch, ...]:
    """Declare an applier's patches (its module calls this at import, with its table); returns
    them. A (mode, target) declared twice with different rows is refused."""
    rows = tuple(rows)
    for patch in rows:
        key = (patch.mode, patch.target)
        if patch.mode not in MODES:
            raise ValueError(f"{patch.target}: unknown mode {patch.mode!r} (one of {list(MODES)})")
        if _DECLARED.get(key, patch) != patch:
            raise ValueError(f"{patch.mode} {patch.target} is declared twice, differently")
        _DECLARED[key] = patch
    return rows


def declared() -> Tuple[Patch, ...]:
    """The patches the modules imported so far declared, by mode (``MODES`` order) and in each
    applier's table order."""
    order = {mode: i for i, mode in enumerate(MODES)}
    return tuple(sorted(_DECLARED.values(), key=lambda p: order[p.mode]))


class UndeclaredPatchError(LookupError):
    """A patch was applied that no applier declared."""


class PatchTargetMissing(AttributeError):
    """A declared target is absent where the registry says it exists."""


def find(mode: str, target: str) -> Patch:
    patch = _DECLARED.get((mode, target))
    if patch is None:
        raise UndeclaredPatchError(
            f"{mode} patches {target}, which its applier does not declare: add a row (target, "
            "reason, parameters, versions) to the table it passes to patches.declare"
        )
    return patch


def of_mode(mode: str) -> List[Patch]:
    return [p for p in declared() if p.mode == mode]


def megatron_version() -> Optional[str]:
    """``"0.16"`` / ``"0.19"``: the imported megatron-core's major.minor (None without it)."""
    try:
        info = importlib.import_module("megatron.core.package_info")
    except ImportError:
        return None
    return f"{info.MAJOR}.{info.MINOR}"


# ------------------------------------------------------------------------------------------------
# applying and removing


@dataclasses.dataclass
class _Applied:
    patch: Patch
    owner: object
    attr: str
    original: object
    owned: bool  # the attribute sat in the owner's own __dict__ (else: inherited, deleted again)
    replacement: object


_ACTIVE: Dict[Tuple[str, str], _Applied] = {}
_HISTORY: List[Patch] = []  # applied in this process, in order (the dry run prints them)
_MISSING = object()


def resolve(target: str):
    """``(owner, attr)`` for ``"module:attr"`` / ``"module:Class.attr"`` (ImportError or
    AttributeError when absent)."""
    module_name, path = target.split(":")
    owner = importlib.import_module(module_name)
    *parents, attr = path.split(".")
    for name in parents:
        owner = getattr(owner, name)
    return owner, attr


def _expected_here(patch: Patch) -> bool:
    """Does the registry say this target exists in the running versions?"""
    if patch.optional:
        return False
    if patch.owner_kind == "megatron-lm" and not _megatron_lm_importable():
        return False  # megatron-core alone (no Megatron-LM checkout): nothing to patch there
    if patch.owner_kind in ("megatron-lm", "megatron-core"):
        version = megatron_version()
        return version is None or version in patch.versions
    return True


def _megatron_lm_importable() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("megatron.training") is not None
    except (ImportError, ValueError):
        return False


def apply(
    mode: str, target: str, replacement=_MISSING, *, make: Optional[Callable] = None, owner=None
):
    """Replace the declared ``target`` by ``replacement`` (or ``make(original)``); returns the
    original. ``owner``: patch this object instead of the target's (an instance of the target's
    class). Applying an applied patch again changes nothing. A target absent where the registry
    allows it (optional, or another Megatron version) is skipped: returns None."""
    patch = find(mode, target)
    key = (mode, target)
    if key in _ACTIVE:
        return _ACTIVE[key].original
    if patch.module == STAND_IN_MODULE:
        return _apply_stand_in(patch, replacement, make)
    try:
        resolved_owner, attr = resolve(target)
        owner = resolved_owner if owner is None else owner
        original = getattr(owner, attr)
    except (ImportError, AttributeError) as exc:
        if not _expected_here(patch):
            return None
        raise PatchTargetMissing(f"{target} is missing ({mode}: {patch.reason})") from exc
    if _is_our_replacement(original, patch):
        return None
    value = make(original) if make is not None else replacement
    owned = attr in vars(owner)
    setattr(owner, attr, value)
    _mark(value, key)
    _ACTIVE[key] = _Applied(patch, owner, attr, original, owned, value)
    _HISTORY.append(patch)
    return original


def _mark(value, key) -> None:
    try:
        value.__tsp_patch__ = key
    except (AttributeError, TypeError):  # a value that takes no attributes (never needed)
        pass


def _is_our_replacement(value, patch: Patch) -> bool:
    """``value`` is what an active patch of the same mode installed for an attribute of the same
    name (a module imported it by name after we patched the module it comes from)."""
    key = getattr(value, "__tsp_patch__", None)
    if not isinstance(key, tuple) or key not in _ACTIVE:
        return False
    return key[0] == patch.mode and _attr_name(key[1]) == _attr_name(patch.target)


def unpatched(value):
    """The object under our active patches (each one's original is the one applied before)."""
    while getattr(value, "__tsp_patch__", None) in _ACTIVE:
        value = _ACTIVE[value.__tsp_patch__].original
    return value


def _attr_name(target: str) -> str:
    return target.split(":")[1].split(".")[-1]


def _apply_stand_in(patch: Patch, replacement, make):
    """Register a stand-in module under its name unless a module of that name is imported."""
    name = ".".join(patch.attr_path)
    if name in sys.modules:
        return None
    module = make(None) if make is not None else replacement
    sys.modules[name] = module
    _ACTIVE[(patch.mode, patch.target)] = _Applied(
        patch, sys.modules, name, _MISSING, False, module
    )
    _HISTORY.append(patch)
    return None


def remove(mode: str, target: str) -> None:
    """Put the original back (no-op when not applied)."""
    applied = _ACTIVE.pop((mode, target), None)
    if applied is None:
        return
    if applied.owner is sys.modules:
        if sys.modules.get(applied.attr) is applied.replacement:
            del sys.modules[applied.attr]
        return
    if applied.owned:
        setattr(applied.owner, applied.attr, applied.original)
    elif applied.attr in vars(applied.owner):
        delattr(applied.owner, applied.attr)


def remove_mode(mode: str) -> None:
    """Remove every active patch of ``mode``, the latest first."""
    for key in reversed([k for k in _ACTIVE if k[0] == mode]):
        remove(*key)


@contextlib.contextmanager
def applied(mode: str, target: str, replacement=_MISSING, *, make=None, owner=None) -> Iterator:
    """``apply`` for the ``with`` block (removed on exit only if this block applied it)."""
    was_active = (mode, target) in _ACTIVE
    original = apply(mode, target, replacement, make=make, owner=owner)
    try:
        yield original
    finally:
        if not was_active:
            remove(mode, target)


def is_active(mode: str, target: str) -> bool:
    return (mode, target) in _ACTIVE


def original(mode: str, target: str):
    return _ACTIVE[(mode, target)].original


def active() -> List[Patch]:
    return [a.patch for a in _ACTIVE.values()]


def applied_in_this_process() -> List[Patch]:
    seen, out = set(), []
    for patch in _HISTORY:
        if (patch.mode, patch.target) not in seen:
            seen.add((patch.mode, patch.target))
            out.append(patch)
    return out


# ------------------------------------------------------------------------------------------------
# printing


def report_lines(patches: Optional[Sequence[Patch]] = None) -> List[str]:
    """One line per patch: state, mode, target and reason (``--tsp-dry-run`` prints these)."""
    patches = applied_in_this_process() if patches is None else patches
    lines = []
    for p in patches:
        state = "active " if is_active(p.mode, p.target) else "removed"
        lines.append(f"{state} {p.mode:<11} {p.target}: {p.reason}")
    return lines
