"""``megatron-tsp`` console entry point: one subcommand per tool (``COMMANDS``)."""

from __future__ import annotations

import importlib
import os
import sys
from typing import List, Optional, Sequence

from megatron_tsp.console import args as cli_args
from megatron_tsp.console import quiet

COMMANDS = {
    "demo": (
        "megatron_tsp.tools.demo",
        "train a small GPT under TSP and TP+SP side by side (gloo)",
    ),
    "plan": ("megatron_tsp.tools.estimator.planner", "analytic memory / comm / throughput planner"),
    "memory": (
        "megatron_tsp.tools.estimator.memory",
        "measured peak memory of one rank (fake tensors)",
    ),
    "moe": (
        "megatron_tsp.tools.estimator.moe",
        "MoE schedules: expert ring vs token dispatch bytes, crossover, ring buffers",
    ),
    "compare": (
        "megatron_tsp.tools.estimator.compare_table",
        "TSP beside TSP x CP, TP+SP (x CP), FSDP x CP and GTP: one planned table",
    ),
    "documents": (
        "megatron_tsp.tools.estimator.documents",
        "packed documents: attention balance across a TSP group per layout",
    ),
    "bench": ("megatron_tsp.tools.bench", "benchmark TSP vs TP+SP layers"),
    "generate": ("megatron_tsp.tools.generate", "TSP prefill + Megatron TP decode (generation)"),
    "prefill-memory": (
        "megatron_tsp.tools.estimator.inference_memory",
        "one rank's peak memory of a long-prompt prefill: TSP / TP / CP",
    ),
    "check-patches": (
        "megatron_tsp.tools.patch_table",
        "check every patch target in this installation and Megatron-LM checkout",
    ),
    "cpu-run": (
        "megatron_tsp.megatron_lm.cpu_runner",
        "run Megatron-LM's pretrain_gpt.py on CPU ranks (gloo), TSP or stock",
    ),
}

USAGE = (
    "usage: megatron-tsp {"
    + ",".join(COMMANDS)
    + "} [options]\n\n"
    + "\n".join(f"  {k:<16}{v[1]}" for k, v in COMMANDS.items())
    + "\n\n'megatron-tsp CMD --help' for options; 'megatron-tsp --debug CMD ...' shows the "
    + "traceback of a refused input; 'megatron-tsp --verbose CMD ...' shows the "
    + "library warnings hidden by default."
)


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    ours = argv.index("--") if "--" in argv else len(argv)  # cpu-run: the script's after --
    if "--debug" in argv[:ours]:
        argv = [a for a in argv[:ours] if a != "--debug"] + argv[ours:]
        os.environ[cli_args.DEBUG_ENV] = "1"
    # global options before the command: --verbose shows the library warnings that are hidden
    # by default (console/quiet.py; ``plan --verbose`` after the command is plan's own option)
    verbose = False
    while argv and argv[0] == "--verbose":
        verbose, argv = True, argv[1:]
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd not in COMMANDS:
        print(f"megatron-tsp: unknown command {cmd!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    # megatron-core's notices of absent CUDA extensions and torch deprecations met by Megatron's
    # code: one line at exit instead, here and in the ranks a tool spawns
    with quiet.Session(verbose) as session:
        try:
            rc = _run(cmd, rest)
        except SystemExit as exc:
            session.report = exc.code != 2  # a refused input stays one line
            raise
        session.report = rc != 2
        return rc


def _run(cmd: str, rest: List[str]) -> int:
    module_name = COMMANDS[cmd][0]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as e:
        if e.name and module_name.startswith(e.name):
            print(
                f"megatron-tsp {cmd}: {module_name} is not available in this installation ({e})",
                file=sys.stderr,
            )
            return 2
        raise
    if not hasattr(module, "main"):
        print(f"megatron-tsp {cmd}: {module_name} has no main(argv)", file=sys.stderr)
        return 2
    try:
        rc = module.main(rest)
    except cli_args.UsageError as exc:  # input a tool could only check once it had started
        if cli_args.debug():
            raise
        print(cli_args.one_line(f"megatron-tsp {cmd}", exc), file=sys.stderr)
        return 2
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
