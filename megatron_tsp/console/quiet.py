"""Quiet by default: the ``megatron-tsp`` tools fold warnings known to be harmless into one line.

On a CPU machine (or any machine without Transformer Engine / apex) megatron-core announces each
optional CUDA extension it falls back from, and Megatron's code calls torch functions that torch
has deprecated; a demo run printed 32 such ``UserWarning`` / ``FutureWarning`` blocks. They say
nothing about the user's run, so ``cli.main`` hides exactly those (``HARMLESS``, matched by
message **and** by the module the warning comes from) and prints, at exit, one line on stderr::

    megatron-tsp: 12 library warnings hidden (megatron-tsp --verbose CMD shows them)

Every other warning is printed as Python prints it. ``megatron-tsp --verbose CMD`` shows all.

Spawned ranks (``demo``, ``generate``, ``bench``, ``cpu-run``) get the same treatment through the
environment: ``ENV`` names a directory where each process that hides a warning keeps its count
(one file per process id); ``megatron_tsp/__init__.py`` calls ``install_from_env()``, so a rank
hides the same warnings from its first import on, and the tool's parent adds the counts up.
``ENV=show`` (``--verbose``) turns hiding off in the ranks too.
"""

from __future__ import annotations

import dataclasses
import os
import re
import shutil
import sys
import tempfile
import warnings
from typing import Optional, Sequence, Tuple

ENV = "MEGATRON_TSP_WARNINGS"
SHOW = "show"


@dataclasses.dataclass(frozen=True)
class Harmless:
    """One kind of warning known to be harmless: its categories, its message (``re.search``),
    the module that issues it (``issuer``, ``re.match`` on the dotted name of the code that calls
    ``warnings.warn``) and, for a warning torch issues, the module whose call into torch raised
    it (``caller``: the first frame outside torch), and why it is harmless."""

    categories: Tuple[type, ...]
    message: str
    issuer: str
    caller: str
    why: str

    def matches(self, category: type, message: str, issuer: str, caller: str) -> bool:
        return (
            issubclass(category, self.categories)
            and re.match(self.issuer, issuer) is not None
            and re.match(self.caller, caller) is not None
            and re.search(self.message, message) is not None
        )


# megatron-core and Megatron-LM (megatron_tsp is not one of them)
MEGATRON = r"megatron\.(core|training|legacy)(\.|$)"
TORCH = r"torch(\.|$)"
ANY = r""
_DEPRECATIONS = (FutureWarning, DeprecationWarning, PendingDeprecationWarning)

HARMLESS: Sequence[Harmless] = (
    Harmless(
        (UserWarning, ImportWarning, RuntimeWarning),
        r"\b(Transformer Engine|Apex|apex)\b.*\bnot installed\b",
        MEGATRON,
        ANY,
        "megatron-core falls back from an optional CUDA extension that is absent",
    ),
    Harmless(
        (UserWarning,) + _DEPRECATIONS,
        r"^full scope is deprecated\. Use empty cuda_graph_scope",
        r"megatron\.core\.transformer\.transformer_config$",
        ANY,
        "megatron-core 0.16 deprecates its own default cuda_graph_scope",
    ),
    Harmless(
        (UserWarning,),
        r"CUDA_DEVICE_MAX_CONNECTIONS|Constraints for invoking optimized fused softmax kernel",
        MEGATRON,
        ANY,
        "GPU-only performance advice (no effect on a CPU run)",
    ),
    Harmless(
        _DEPRECATIONS,
        r"",
        TORCH,
        MEGATRON,
        "a torch deprecation met by Megatron's own code (torch issues it, Megatron called it)",
    ),
    Harmless(
        (UserWarning,),
        r"^'pin_memory' argument is set as true but no accelerator is found",
        TORCH,
        MEGATRON,
        "Megatron's data loader pins memory; on CPU there is no device to pin for",
    ),
)

_WRAPPERS = ("warnings", "contextlib", "functools", __name__)


def issuer_and_caller(filename: str, frame=None) -> Tuple[str, str]:
    """The dotted module that issued a warning (the code whose line ``filename`` names) and the
    first module outside torch below it on the stack (for a warning torch issues, the code that
    called torch; else the issuer itself)."""
    f = frame
    while f is not None and f.f_code.co_filename != filename:
        f = f.f_back
    if f is None:  # no frame at hand (a warning re-issued by hand): from the path
        issuer = _module_from_path(filename)
        return issuer, issuer
    issuer = f.f_globals.get("__name__", "")
    if not re.match(TORCH, issuer):
        return issuer, issuer
    while f is not None:
        name = f.f_globals.get("__name__", "")
        if name and not re.match(TORCH, name) and not name.startswith(_WRAPPERS):
            return issuer, name
        f = f.f_back
    return issuer, ""


def _module_from_path(filename: str) -> str:
    parts = os.path.normpath(filename).split(os.sep)
    for i, part in enumerate(parts):
        if part in ("megatron", "torch") and filename.endswith(".py"):
            return ".".join(parts[i:])[: -len(".py")]
    return ""


def is_harmless(category: type, message: str, issuer: str, caller: str) -> Optional[Harmless]:
    for rule in HARMLESS:
        if rule.matches(category, message, issuer, caller):
            return rule
    return None


class _Hider:
    """``warnings.showwarning`` replacement: counts the harmless warnings, passes the others on."""

    def __init__(self, previous, tally_dir: Optional[str]):
        self.previous = previous
        self.tally_dir = tally_dir
        self.hidden = 0

    def __call__(self, message, category, filename, lineno, file=None, line=None):
        issuer, caller = issuer_and_caller(filename, sys._getframe(1))
        if is_harmless(category, str(message), issuer, caller):
            self.hidden += 1
            self._tally()
            return
        self.previous(message, category, filename, lineno, file, line)

    def _tally(self) -> None:
        # written on every hidden warning: a forked rank leaves with os._exit (no atexit)
        if not self.tally_dir:
            return
        try:
            with open(os.path.join(self.tally_dir, str(os.getpid())), "w") as f:
                f.write(str(self.hidden))
        except OSError:  # the parent has finished and removed the directory
            pass


_hider: Optional[_Hider] = None


def install(tally_dir: Optional[str] = None) -> _Hider:
    """Hide ``HARMLESS`` warnings in this process (idempotent); counts go to ``tally_dir``."""
    global _hider
    if _hider is not None and warnings.showwarning is _hider:
        _hider.tally_dir = tally_dir or _hider.tally_dir
        return _hider
    _hider = _Hider(warnings.showwarning, tally_dir)
    warnings.showwarning = _hider
    return _hider


def uninstall() -> None:
    global _hider
    if _hider is not None and warnings.showwarning is _hider:
        warnings.showwarning = _hider.previous
    _hider = None


def install_from_env() -> None:
    """In a spawned rank: hide as the parent tool does when ``ENV`` names a tally directory."""
    value = os.environ.get(ENV, "")
    if value and value != SHOW and os.path.isdir(value):
        install(value)


class Session:
    """``cli.main``'s use: ``with Session(verbose) as s: ...``; on exit, the one summary line
    (this process's hidden warnings plus every spawned rank's) on stderr."""

    def __init__(self, verbose: bool, prog: str = "megatron-tsp"):
        self.verbose, self.prog = verbose, prog
        self.report = True  # False: no summary line (cli.main: a refused input is one line)
        self.tally_dir: Optional[str] = None
        self._saved_env: Optional[str] = None
        self._hider: Optional[_Hider] = None

    def __enter__(self) -> "Session":
        self._saved_env = os.environ.get(ENV)
        if self.verbose:
            os.environ[ENV] = SHOW
            return self
        self.tally_dir = tempfile.mkdtemp(prefix="megatron_tsp_warnings_")
        os.environ[ENV] = self.tally_dir
        self._hider = install(None)
        self._hider.hidden = 0
        return self

    def hidden(self) -> int:
        total = self._hider.hidden if self._hider is not None else 0
        if self.tally_dir and os.path.isdir(self.tally_dir):
            for name in os.listdir(self.tally_dir):
                if name == str(os.getpid()):
                    continue
                try:
                    with open(os.path.join(self.tally_dir, name)) as f:
                        total += int(f.read() or 0)
                except (OSError, ValueError):
                    pass
        return total

    def __exit__(self, *exc) -> None:
        n = self.hidden()
        if self._hider is not None:
            uninstall()
        if self.tally_dir:
            shutil.rmtree(self.tally_dir, ignore_errors=True)
        if self._saved_env is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = self._saved_env
        if n and self.report:
            print(summary_line(n, self.prog), file=sys.stderr, flush=True)


def summary_line(n: int, prog: str = "megatron-tsp") -> str:
    what = "library warning" if n == 1 else "library warnings"
    return f"{prog}: {n} {what} hidden ({prog} --verbose CMD shows them)"
