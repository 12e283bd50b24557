"""Add (or check) the megatron-tsp ``install()`` hook in a Megatron-LM checkout's pretrain_gpt.py.

    python patches/apply.py /path/to/Megatron-LM            # apply the patch for its tag, verify
    python patches/apply.py /path/to/Megatron-LM --check    # verify only (exit 1 if absent)
    python patches/apply.py /path/to/Megatron-LM --run      # also run pretrain_gpt.py --help
    python patches/apply.py --regenerate /path/to/mirror.git TAG...   # rebuild patch files

The patch is the same two lines in every tag, placed before the script's first Megatron import
(``from gpt_builders import gpt_builder``) so the hooks are in place before the script binds
``pretrain``, ``get_batch_on_this_cp_rank`` and ``validate_args``. ``patches/<tag>.patch`` are
``git apply``/``patch -p1`` files; a checkout whose tag has no patch file gets the same lines
inserted at the same anchor (the anchor must appear exactly once).
"""

from __future__ import annotations

import argparse
import difflib
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
TARGET = "pretrain_gpt.py"
ANCHOR = "from gpt_builders import gpt_builder\n"
HOOK = [
    "import megatron_tsp.megatron_lm  # megatron-tsp: --tensor-sequence-parallel-size D\n",
    "megatron_tsp.megatron_lm.install()\n",
]


def patched_text(original: str) -> str:
    if HOOK[1] in original:
        return original
    lines = original.splitlines(keepends=True)
    at = [i for i, line in enumerate(lines) if line == ANCHOR]
    if len(at) != 1:
        raise SystemExit(
            f"{TARGET}: expected exactly one line {ANCHOR.strip()!r} to anchor the hook, "
            f"found {len(at)}; add the two hook lines before the first Megatron import by hand:\n"
            + "".join(HOOK)
        )
    return "".join(lines[: at[0]] + HOOK + lines[at[0] :])


def make_patch(original: str) -> str:
    return "".join(
        difflib.unified_diff(
            original.splitlines(keepends=True),
            patched_text(original).splitlines(keepends=True),
            fromfile=f"a/{TARGET}",
            tofile=f"b/{TARGET}",
        )
    )


def verify(checkout: str, run: bool = False) -> list:
    """Problems with the hook in ``checkout`` (empty: verified)."""
    path = os.path.join(checkout, TARGET)
    text = open(path).read()
    problems = []
    lines = text.splitlines(keepends=True)
    hook_at = [i for i, line in enumerate(lines) if line == HOOK[1]]
    if len(hook_at) != 1:
        return [f"{path}: the line {HOOK[1].strip()!r} appears {len(hook_at)} times (want 1)"]
    first_megatron = next(
        i
        for i, line in enumerate(lines)
        if line.startswith(("from megatron", "import megatron", ANCHOR))
        and "megatron_tsp" not in line
    )
    if hook_at[0] > first_megatron:
        problems.append(
            f"{path}: the hook must come before line {first_megatron + 1} "
            f"({lines[first_megatron].strip()!r})"
        )
    compile(text, path, "exec")
    if run and not problems:
        env = dict(os.environ)
        repo = os.path.dirname(HERE)
        env["PYTHONPATH"] = repo + os.pathsep + env.get("PYTHONPATH", "")
        proc = subprocess.run(
            [sys.executable, path, "--help"],
            cwd=checkout,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        if proc.returncode != 0 or "tensor-sequence parallel" not in proc.stdout:
            problems.append(
                f"{path} --help does not show the TSP group (rc={proc.returncode}):"
                f"\n{proc.stderr[-2000:]}"
            )
    return problems


def tag_of(checkout: str):
    try:
        out = subprocess.run(
            ["git", "-C", checkout, "describe", "--tags", "--exact-match"],
            capture_output=True,
            text=True,
        )
        return out.stdout.strip() or None
    except OSError:
        return None


def apply(checkout: str) -> str:
    path = os.path.join(checkout, TARGET)
    original = open(path).read()
    if HOOK[1] in original:
        return "already patched"
    tag = tag_of(checkout)
    patch_file = os.path.join(HERE, f"{tag}.patch") if tag else None
    if patch_file and os.path.isfile(patch_file):
        proc = subprocess.run(
            ["patch", "-p1", "--forward", "-i", patch_file],
            cwd=checkout,
            capture_output=True,
            text=True,
        )
        if proc.returncode != 0:
            raise SystemExit(f"patch {patch_file} failed:\n{proc.stdout}{proc.stderr}")
        return f"applied {os.path.basename(patch_file)}"
    with open(path, "w") as f:
        f.write(patched_text(original))
    return f"inserted the hook before {ANCHOR.strip()!r} (no patch file for tag {tag})"


def regenerate(mirror: str, tags) -> None:
    for tag in tags:
        original = subprocess.run(
            ["git", "-C", mirror, "show", f"{tag}:{TARGET}"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        name = os.path.join(HERE, f"{tag}.patch")
        with open(name, "w") as f:
            f.write(make_patch(original))
        print(f"wrote {name}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkout", nargs="?")
    parser.add_argument("--check", action="store_true", help="verify only")
    parser.add_argument(
        "--run",
        action="store_true",
        help="also run pretrain_gpt.py --help and look for the TSP group",
    )
    parser.add_argument("--regenerate", nargs="+", metavar=("MIRROR", "TAG"))
    ns = parser.parse_args(argv)
    if ns.regenerate:
        regenerate(ns.regenerate[0], ns.regenerate[1:])
        return 0
    if not ns.checkout:
        parser.error("give a Megatron-LM checkout")
    if not ns.check:
        print(apply(ns.checkout))
    problems = verify(ns.checkout, run=ns.run)
    if problems:
        print("\n".join(problems), file=sys.stderr)
        return 1
    print(
        f"verified: {os.path.join(ns.checkout, TARGET)} calls megatron_tsp.megatron_lm.install() "
        "before its first Megatron import"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
