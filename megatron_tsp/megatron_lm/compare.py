"""Compare Megatron-LM training logs of A/B variants (TSP vs TP+SP vs CP).

    python -m megatron_tsp.megatron_lm.compare tsp=logs/tsp.log tp=logs/tp.log [--png loss.png]
    python -m megatron_tsp.megatron_lm.compare tsp=tb/tsp tp=tb/tp     # TensorBoard event dirs

Each ``NAME=PATH`` is a log file or TensorBoard event files (a ``*tfevents*`` file or a directory
holding them, as written by ``--tensorboard-dir``; read by ``event_files`` without TensorBoard).

Parses what Megatron prints: the per-iteration lines (``iteration N/ M | ... | elapsed time per
iteration (ms): T | throughput per GPU (TFLOP/s/GPU): F | ... | global batch size: B | lm loss: L
| ...``), the memory reports (``[Rank r] (after N iterations) memory (MB) | allocated: ... | max
allocated: ...``) and the argument dump (``seq_length ....... S``, ``world_size ....... W``).
Prints a side-by-side table (final / mean loss, loss at step 1, ms per iteration, tokens/s,
TFLOP/s/GPU, peak memory) and, with ``--png``, the loss curves (needs matplotlib: the ``plot``
extra). The first ``--skip`` iterations (default 1: warm-up) are left out of the time averages.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

_ITER = re.compile(r"\biteration\s+(\d+)\s*/\s*(\d+)\s*\|")
_FIELD = re.compile(r"\|\s*([^|:]+?)\s*:\s*([-+0-9.eEnaNinf]+)\s*(?=\|)")
_MEM = re.compile(
    r"\[Rank (\d+)\].*?memory \(MB\)\s*\|\s*allocated:\s*([0-9.]+)\s*\|\s*max allocated:\s*"
    r"([0-9.]+)(?:\s*\|\s*reserved:\s*([0-9.]+))?(?:\s*\|\s*max reserved:\s*([0-9.]+))?"
)
_ARG = re.compile(
    r"^\s+(seq_length|world_size|global_batch_size|micro_batch_size|"
    r"tensor_model_parallel_size|tensor_sequence_parallel_size|"
    r"context_parallel_size|data_parallel_size)\s\.+\s(\S+)\s*$"
)


@dataclass
class RunLog:
    name: str
    path: str
    iterations: List[int] = field(default_factory=list)
    loss: List[float] = field(default_factory=list)
    ms_per_iter: List[float] = field(default_factory=list)
    tflops: List[float] = field(default_factory=list)
    global_batch: List[int] = field(default_factory=list)
    max_allocated_mb: Dict[int, float] = field(default_factory=dict)
    max_reserved_mb: Dict[int, float] = field(default_factory=dict)
    args: Dict[str, str] = field(default_factory=dict)

    def arg_int(self, name: str) -> Optional[int]:
        value = self.args.get(name)
        try:
            return int(value) if value is not None else None
        except ValueError:
            return None


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        return math.nan


def parse_log(path: str, name: Optional[str] = None) -> RunLog:
    run = RunLog(name=name or path, path=path)
    with open(path, errors="replace") as f:
        for line in f:
            m = _ARG.match(line)
            if m:
                run.args.setdefault(m.group(1), m.group(2))
                continue
            m = _MEM.search(line)
            if m:
                rank = int(m.group(1))
                run.max_allocated_mb[rank] = max(
                    run.max_allocated_mb.get(rank, 0.0), float(m.group(3))
                )
                if m.group(5):
                    run.max_reserved_mb[rank] = max(
                        run.max_reserved_mb.get(rank, 0.0), float(m.group(5))
                    )
                continue
            m = _ITER.search(line)
            if not m:
                continue
            fields = {k.strip(): v for k, v in _FIELD.findall(line[m.start() :] + "|")}
            if "lm loss" not in fields:
                continue  # skipped / nan iterations, validation lines
            run.iterations.append(int(m.group(1)))
            run.loss.append(_number(fields["lm loss"]))
            run.ms_per_iter.append(_number(fields.get("elapsed time per iteration (ms)", "nan")))
            run.tflops.append(_number(fields.get("throughput per GPU (TFLOP/s/GPU)", "nan")))
            gbs = fields.get("global batch size")
            run.global_batch.append(int(float(gbs)) if gbs else -1)
    if not run.iterations:
        raise ValueError(f"{path}: no Megatron iteration lines with 'lm loss' found")
    return run


def parse_events(path: str, name: Optional[str] = None) -> RunLog:
    """A ``RunLog`` from Megatron's TensorBoard scalars: ``lm loss``, ``iteration-time`` (s),
    ``throughput`` (TFLOP/s/GPU), ``batch-size``, ``mem-max-allocated-bytes`` /
    ``mem-reserved-bytes`` (written by the last rank, which owns the writer) and the argument
    texts."""
    from megatron_tsp.megatron_lm import event_files

    events = event_files.read_run(path)
    run = RunLog(name=name or path, path=path)
    for key in (
        "seq_length",
        "world_size",
        "global_batch_size",
        "micro_batch_size",
        "tensor_model_parallel_size",
        "tensor_sequence_parallel_size",
        "context_parallel_size",
        "data_parallel_size",
    ):
        if key in events.texts:
            run.args[key] = events.texts[key].strip()
    losses = events.series("lm loss")
    if not losses:
        raise ValueError(f"{path}: no 'lm loss' scalars in the TensorBoard event files")
    seconds = dict(events.series("iteration-time"))
    tflops = dict(events.series("throughput"))
    batch = dict(events.series("batch-size"))
    for step, loss in losses:
        run.iterations.append(step)
        run.loss.append(loss)
        run.ms_per_iter.append(seconds[step] * 1000.0 if step in seconds else math.nan)
        run.tflops.append(tflops.get(step, math.nan))
        run.global_batch.append(int(batch[step]) if step in batch else -1)
    world = run.arg_int("world_size")
    writer_rank = world - 1 if world else 0
    for tag, target in (
        ("mem-max-allocated-bytes", run.max_allocated_mb),
        ("mem-reserved-bytes", run.max_reserved_mb),
    ):
        values = [v for _, v in events.series(tag)]
        if values:
            target[writer_rank] = max(values) / 2**20
    return run


def parse_run(path: str, name: Optional[str] = None) -> RunLog:
    """A log file or TensorBoard event files (see the module docstring)."""
    from megatron_tsp.megatron_lm import event_files

    if event_files.is_event_path(path):
        return parse_events(path, name)
    return parse_log(path, name)


def _mean(values: Sequence[float]) -> float:
    good = [v for v in values if not math.isnan(v)]
    return sum(good) / len(good) if good else math.nan


def summarize(run: RunLog, skip: int = 1) -> Dict[str, float]:
    timed = slice(skip, None) if len(run.iterations) > skip else slice(0, None)
    ms = _mean(run.ms_per_iter[timed])
    seq = run.arg_int("seq_length")
    world = run.arg_int("world_size")
    gbs = (
        run.global_batch[-1]
        if run.global_batch and run.global_batch[-1] > 0
        else (run.arg_int("global_batch_size") or -1)
    )
    tokens_per_s = gbs * seq / (ms / 1000.0) if seq and gbs > 0 and ms > 0 else math.nan
    return {
        "iterations": run.iterations[-1],
        "loss@first": run.loss[0],
        "loss@last": run.loss[-1],
        "loss mean": _mean(run.loss),
        "ms/iter": ms,
        "tokens/s": tokens_per_s,
        "tokens/s/GPU": tokens_per_s / world if world else math.nan,
        "TFLOP/s/GPU": _mean(run.tflops[timed]),
        "max alloc MB": max(run.max_allocated_mb.values()) if run.max_allocated_mb else math.nan,
        "max reserved MB": max(run.max_reserved_mb.values()) if run.max_reserved_mb else math.nan,
    }


def _fmt(value) -> str:
    if isinstance(value, int):
        return str(value)
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    if abs(value) >= 1e5:
        return f"{value:,.0f}"
    if abs(value) >= 100:
        return f"{value:.1f}"
    return f"{value:.4f}"


def table(runs: List[RunLog], skip: int = 1) -> str:
    summaries = [summarize(r, skip) for r in runs]
    rows = list(summaries[0].keys())
    width = max(len(r) for r in rows) + 2
    cols = [max(12, len(r.name) + 2) for r in runs]
    out = ["".ljust(width) + "".join(r.name.rjust(c) for r, c in zip(runs, cols))]
    for row in rows:
        out.append(
            row.ljust(width) + "".join(_fmt(s[row]).rjust(c) for s, c in zip(summaries, cols))
        )
    common = sorted(set.intersection(*(set(r.iterations) for r in runs)))
    if common and len(runs) > 1:
        base = runs[0]
        first = common[0]
        diffs = []
        for r in runs[1:]:
            a = base.loss[base.iterations.index(first)]
            b = r.loss[r.iterations.index(first)]
            diffs.append(f"{r.name} - {base.name} = {b - a:+.3e}")
        out.append(f"lm loss at iteration {first}: " + "; ".join(diffs))
    return "\n".join(out)


def plot(runs: List[RunLog], png: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise SystemExit(
            "--png needs matplotlib: pip install matplotlib (or the megatron-tsp[plot] extra)"
        ) from exc
    fig, ax = plt.subplots(figsize=(7, 4))
    for r in runs:
        ax.plot(r.iterations, r.loss, label=r.name, marker="." if len(r.loss) < 50 else None)
    ax.set_xlabel("iteration")
    ax.set_ylabel("lm loss")
    ax.set_title("Megatron-LM A/B: lm loss")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    plt.close(fig)


def _named(items: Sequence[str]) -> List[Tuple[str, str]]:
    out = []
    for item in items:
        name, sep, path = item.partition("=")
        out.append((name, path) if sep and path else (item.rsplit("/", 1)[-1], item))
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m megatron_tsp.megatron_lm.compare", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "logs",
        nargs="+",
        metavar="[NAME=]LOG_OR_EVENTS",
        help="a Megatron log, or TensorBoard event files (file or directory)",
    )
    parser.add_argument("--png", default=None, help="write the loss curves to this PNG")
    parser.add_argument(
        "--skip",
        type=int,
        default=1,
        help="warm-up iterations left out of time averages (default 1)",
    )
    ns = parser.parse_args(argv)
    try:
        runs = [parse_run(path, name) for name, path in _named(ns.logs)]
    except (OSError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(table(runs, ns.skip))
    if ns.png:
        plot(runs, ns.png)
        print(f"loss curves written to {ns.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
