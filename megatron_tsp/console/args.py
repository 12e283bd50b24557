"""Command-line input of the ``megatron-tsp`` tools, checked in one place before any work.

Every tool builds its parser with ``ToolParser`` and the ``type=`` helpers below, and registers
its cross-argument checks (world size vs group sizes, a model shape that must split over D, a
directory that must exist, ...) with ``ToolParser.add_check``; they run right after parsing,
before a rank is spawned, a model built or a step trained. Bad input is ONE line on stderr naming
the flag and the value, ``megatron-tsp CMD: error: --flag: message``, and exit status 2
(argparse's); ``megatron-tsp --debug CMD ...`` shows the traceback of a refusal instead.

A check raises ``UsageError(flag, message)``; ``ValueError`` from ``megatron_tsp.core.validation``
(whose messages already name the flags) is wrapped with ``from_value_error``. ``cli.main`` also
turns a ``UsageError`` raised later by a tool (input only readable once work has started) into
the same line.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Callable, List, Optional, Sequence

# ``megatron-tsp --debug CMD``: refusals raise with their traceback (inherited by spawned ranks)
DEBUG_ENV = "MEGATRON_TSP_DEBUG"


def debug() -> bool:
    return os.environ.get(DEBUG_ENV, "") not in ("", "0")


class UsageError(Exception):
    """Bad command-line input: ``flag`` (``--seq-length``, or several, ``--tp / --world-size``)
    and what is wrong with its value."""

    def __init__(self, flag: str, message: str):
        super().__init__(f"{flag}: {message}" if flag else message)
        self.flag = flag


def from_value_error(exc: ValueError, flag: str = "") -> UsageError:
    """A ``ValueError`` of ``megatron_tsp.core.validation`` (its message names the flags and
    numbers) as a ``UsageError``; ``flag`` is prefixed only when the message lacks it."""
    text = " ".join(str(exc).split())
    return UsageError("" if not flag or flag in text else flag, text)


def one_line(prog: str, message: str) -> str:
    return f"{prog}: error: {' '.join(str(message).split())}"


# ------------------------------------------------------------------------------------------------
# type= helpers: argparse reports ``argument --flag: <message>``


def _number(kind: Callable, text: str, what: str):
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {what}") from None


def positive_int(text: str) -> int:
    value = _number(int, text, "an integer")
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = _number(int, text, "an integer")
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def positive_float(text: str) -> float:
    value = _number(float, text, "a number")
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def non_negative_float(text: str) -> float:
    value = _number(float, text, "a number")
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


def fraction(text: str) -> float:
    """A number in (0, 1] (``--top-p``, ``--efficiency``)."""
    value = _number(float, text, "a number")
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text}")
    return value


def _int_list(text: str, what: str, minimum: int) -> List[int]:
    items = [x.strip() for x in text.split(",") if x.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"{text!r}: give comma-separated {what}")
    values = [_number(int, x, "an integer") for x in items]
    bad = [v for v in values if v < minimum]
    if bad:
        raise argparse.ArgumentTypeError(f"{what} must be >= {minimum}, got {bad[0]}")
    return values


def positive_int_list(text: str) -> List[int]:
    """Comma-separated positive integers (sequence lengths): ``"4096,8192"``."""
    return _int_list(text, "positive integers", 1)


def existing_dir(text: str) -> str:
    if not os.path.isdir(text):
        what = "is not a directory" if os.path.exists(text) else "does not exist"
        raise argparse.ArgumentTypeError(f"{text} {what}")
    return text


# ------------------------------------------------------------------------------------------------


Check = Callable[[argparse.Namespace], None]


class ToolParser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` whose errors are one line and whose ``parse_args`` runs the
    registered cross-argument checks (``add_check``) before returning."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._checks: List[Check] = []

    def add_check(self, check: Check) -> Check:
        """``check(args)`` raises ``UsageError`` (or ``ValueError`` naming its flags); usable as
        a decorator."""
        self._checks.append(check)
        return check

    def parse_args(self, args: Optional[Sequence[str]] = None, namespace=None):
        parsed = super().parse_args(args, namespace)
        try:
            for check in self._checks:
                check(parsed)
        except (UsageError, ValueError) as exc:
            if debug():
                raise
            self.error(str(exc))
        return parsed

    def error(self, message: str):
        if debug():
            print(self.format_usage().rstrip(), file=sys.stderr)
        print(one_line(self.prog, message), file=sys.stderr)
        sys.exit(2)
