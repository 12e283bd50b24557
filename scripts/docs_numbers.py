"""Regenerate the numbers and tables in README.md and docs/ that a ``megatron-tsp`` command prints.

Each generated block is registered in ``BLOCKS``: the file, an id, the exact ``megatron-tsp``
command(s) it runs, a scale ("small": analytic tools, seconds; "full": fake-tensor runs at full
scale, or plans that record many layers' kernels first, minutes) and a formatter that turns the
commands' stdout into the block's text. In the file a block is delimited by markers that name its
commands::

    <!-- generated (ID) by scripts/docs_numbers.py from:
    megatron-tsp ...
    -->
    ...
    <!-- end generated (ID) -->

    python3 scripts/docs_numbers.py --check [--scale small|full|all]  # exit 1 on a differing block
    python3 scripts/docs_numbers.py --write [--scale ...] [--only ID]  # rewrite the blocks

Only stdout is read (warnings and progress go to stderr); no block holds a timing.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import io
import json
import os
import re
import shlex
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Sequence, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:  # in-process tools from this checkout, not an installed copy
    sys.path.insert(0, ROOT)
PROG = "megatron-tsp"
# analytic tools: run in this process (no import per command)
IN_PROCESS = ("plan", "moe", "compare", "documents")


@dataclass
class Block:
    file: str  # relative to the repository root
    id: str
    commands: List[str]  # each "megatron-tsp CMD ARGS"
    scale: str  # "small" or "full"
    format: Callable[["Block", List[str]], str]  # (block, stdout per command) -> text
    labels: List[str] = field(default_factory=list)  # row labels, one per command (tables)


# ------------------------------------------------------------------------------------------------
# formatters: stdout of the block's commands -> the text between the markers


def verbatim(block: Block, outs: List[str]) -> str:
    """The commands' stdout, trailing blanks removed (the tool already prints markdown)."""
    return "\n\n".join("\n".join(x.rstrip() for x in o.strip("\n").splitlines()) for o in outs)


def _section(out: str, start: str) -> List[str]:
    lines = out.splitlines()
    first = next(i for i, x in enumerate(lines) if x.startswith(start))
    end = next((i for i in range(first, len(lines)) if not lines[i].strip()), len(lines))
    return [x.rstrip() for x in lines[first:end]]


def layer_time(block: Block, outs: List[str]) -> str:
    """plan's "Per-layer step time ..." lines, as a code block."""
    return "```\n" + "\n".join(_section(outs[0], "Per-layer step time")) + "\n```"


def layer_time_sentence(block: Block, outs: List[str]) -> str:
    """plan's per-layer step time as one sentence (README)."""
    lines = _section(outs[0], "Per-layer step time")
    rows = {}
    for x in lines[1:]:
        m = re.match(r"\s+(\S+)\s+recompute (\S+)\s+mem\s+([\d.]+) GB\s+layer\s+([\d.]+) ms", x)
        if m:
            rows[m.group(1)] = m.groups()[1:]
    ratio = re.search(r"per-layer time: ([\d.]+)x", "\n".join(lines)).group(1)
    (ts, tp) = rows["TSP8"], rows["TP8+SP"]
    return (
        f"TSP {ts[2]} ms per layer (recompute {ts[0]}, {ts[1]} GB) vs TP+SP {tp[2]} ms "
        f"(recompute {tp[0]}, {tp[1]} GB), {ratio}×"
    )


_CP_LINE = re.compile(r"^\s+C=(\d+)\s+DP=(\d+)\s+(.*)$")
_CP_PART = re.compile(
    r"^(.+?): (?:nothing fits \(([\d.]+) GB\)|(.+), ([\d.]+) GB, ([\d.]+) s, ([\d.]+)k tok/s)$"
)


SETTINGS = {"none (attention recompute)": "attn"}  # plan's recompute settings, short


def tsp_cp_table(block: Block, outs: List[str]) -> str:
    """plan's "TSP x CP vs TP+SP x CP at equal C" lines of each command (one per GPU count) as
    one markdown table; the two ratios are the printed step times' quotients."""
    head = (
        "| GPUs | C | DP | TSP8×C: recompute, GB, tok/s | TSP8×C ring (what-if): recompute, "
        "GB, tok/s | TP8+SP×C: recompute, GB, tok/s | step TSP / TP+SP | ring / all-gather |\n"
        "|---:|---:|---:|---|---|---|---:|---:|"
    )
    rows = [head]
    for cmd, out in zip(block.commands, outs):
        gpus = shlex.split(cmd)[shlex.split(cmd).index("--gpus") + 1]
        for line in _section(out, "TSP x CP vs TP+SP x CP")[1:]:
            m = _CP_LINE.match(line)
            if not m:
                continue
            cells, steps = [], []
            for part in m.group(3).split(" | "):
                p = _CP_PART.match(part.strip())
                if p.group(2):
                    cells.append(f"nothing fits ({p.group(2)})")
                    steps.append(None)
                else:
                    setting = SETTINGS.get(p.group(3), p.group(3))
                    cells.append(f"{setting}, {p.group(4)}, {p.group(6)}k")
                    steps.append(float(p.group(5)))
            tsp, ring, tp = steps
            r1 = f"{tsp / tp:.2f}" if tsp and tp else "-"
            r2 = f"{ring / tsp:.2f}" if tsp and ring else "-"
            rows.append(f"| {gpus} | {m.group(1)} | {m.group(2)} | " + " | ".join(cells))
            rows[-1] += f" | {r1} | {r2} |"
    return "\n".join(rows)


def plan_excerpt(block: Block, outs: List[str]) -> str:
    """plan's table, the rows of the strategies in ``block.labels``, and its crossover lines for
    TSP and the hybrid against TP+SP, as a code block."""
    lines = [x.rstrip() for x in outs[0].splitlines()]
    head = next(i for i, x in enumerate(lines) if x.startswith("strategy"))
    table = lines[head + 2 : lines.index("", head)]
    rows = [x for x in table if not x.startswith(" ") and x.split()[0] in block.labels]
    keep = ("TSP vs TP+SP", "hybrid", "predicted tokens/s")
    cross = [x.strip() for x in _section(outs[0], "Crossover") if any(k in x for k in keep)]
    return "```\n" + "\n".join(lines[head : head + 2] + rows + [""] + cross) + "\n```"


def moe_plan_table(block: Block, outs: List[str]) -> str:
    """plan for MoE models: each strategy's memory, recompute, step and tokens/s (its table) and
    the expert schedule it picked (its "Mixture of experts" lines); one command per (model, S)."""
    rows = [
        "| model | S | strategy | experts | mem GB none / full | rc | step s | tokens/s |",
        "|---|---:|---|---|---:|---|---:|---:|",
    ]
    last_model = None
    for cmd, out in zip(block.commands, outs):
        argv = shlex.split(cmd)
        model, seq = argv[argv.index("--model") + 1], int(argv[argv.index("--seq-length") + 1])
        experts = dict(re.findall(r"^\s+(\S+): experts (\w+)", out, re.M))
        lines = out.splitlines()
        head = next(i for i, x in enumerate(lines) if x.startswith("strategy"))
        for k, line in enumerate(lines[head + 2 :]):
            if not line.strip() or line.startswith(" "):
                break
            tok = line.split()
            mem = tok[2].replace("/", " / ")
            first = k == 0
            rows.append(
                f"| {model if first and model != last_model else ''} | "
                f"{f'{seq // 1024}k' if first else ''} | {tok[0]} | {experts[tok[0]]} | {mem} | "
                f"{tok[3]} | {tok[-4]} | {tok[-3]} |"
            )
        last_model = model
    return "\n".join(rows)


def _memory_row(out: str) -> Tuple[str, str, str]:
    """(peak GB, phase of the peak, GB received per step) of memory's one-row table."""
    lines = out.splitlines()
    h = next(i for i, x in enumerate(lines) if x.startswith("layout"))
    tok = lines[h + 2].split()
    paper = "paper" in lines[h].split()
    # from the right: time s, comm GB, attn TF, GEMM TF, [paper], at, peak
    at = -6 if paper else -5
    return tok[at - 1], tok[at], tok[-2]


_FIELDS = ("S", "rec", "params", "grads", "optim", "activ", "temp", "peak", "at")


def _memory_rows(out: str) -> List[Dict[str, str]]:
    """Every row of ``memory``'s table (one run, or ``--table``'s rows) as {column: text}, the
    label under "layout"; read from the right, so labels may hold spaces."""
    lines = out.splitlines()
    h = next(i for i, x in enumerate(lines) if x.startswith("layout"))
    paper = "paper" in lines[h].split()
    rows = []
    for line in lines[h + 2 :]:
        tok = line.split()
        if len(tok) < 14 or not re.fullmatch(r"\d+", tok[-1]):
            continue
        tail = ["GEMM", "attn", "comm", "time"]
        n = len(_FIELDS) + int(paper) + len(tail)
        names = list(_FIELDS) + (["paper"] if paper else []) + tail
        row = dict(zip(names, tok[-n:]))
        row["layout"] = " ".join(tok[:-n])
        rows.append(row)
    return rows


def memory_flops_table(block: Block, outs: List[str]) -> str:
    """One row per ``memory`` command: the label, S, recompute, GB per rank at the peak (model
    state = params + grads + optimizer, activations, temporaries, the peak) and where it is
    reached, the paper's number (7B), GEMM and attention TFLOP, GB received per rank per step."""
    rows = [
        "| layout | S | recompute | state | activ. | temp | **peak** | peak in | paper | GEMM TF "
        "| attention TF | received GB |",
        "|---|---|---|---:|---:|---:|---:|---|---:|---:|---:|---:|",
    ]
    for label, out in zip(block.labels, outs):
        r = _memory_rows(out)[0]
        s = f"{int(r['S']) // 1024}k"
        state = sum(float(r[k]) for k in ("params", "grads", "optim"))
        rows.append(
            f"| {label} | {s} | {r['rec']} | {state:.2f} | {r['activ']} | {r['temp']} | "
            f"**{r['peak']}** | {r['at']} | {r.get('paper', '-')} | {r['GEMM']} | {r['attn']} | "
            f"{r['comm']} |"
        )
    return "\n".join(rows)


def moe_memory_table(block: Block, outs: List[str]) -> str:
    """``memory --model M --table`` of MoE models: every row, GB per rank."""
    rows = [
        "| model | S | layout | params | grads | optim | activations | temp | peak | "
        "comm GB / step |",
        "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for cmd, out in zip(block.commands, outs):
        argv = shlex.split(cmd)
        model, first_s = argv[argv.index("--model") + 1], None
        for k, r in enumerate(_memory_rows(out)):
            s = f"{int(r['S']) // 1024}k"
            rows.append(
                f"| {model if k == 0 else ''} | {s if s != first_s else ''} | {r['layout']} | "
                + " | ".join(r[c] for c in ("params", "grads", "optim", "activ", "temp", "peak"))
                + f" | {r['comm']} |"
            )
            first_s = s
    return "\n".join(rows)


def memory_table(block: Block, outs: List[str]) -> str:
    """One row per ``memory`` command: the label, peak GB per rank, where it is reached, the bytes
    the rank receives per step."""
    rows = ["| layout | peak GB per rank | peak in | received GB / step |", "|---|---:|---|---:|"]
    for label, out in zip(block.labels, outs):
        peak, at, comm = _memory_row(out)
        rows.append(f"| {label} | {peak} | {at} | {comm} |")
    return "\n".join(rows)


def cp_pivot(block: Block, outs: List[str]) -> str:
    """``memory`` runs as a table with one row per (S, C) and one column per layout; each label is
    "S|C|layout". Cells are peak GB per rank ("-" where not run); the last column is the bytes
    received per step by ``TSP8×C`` and ``TP8+SP×C`` (no recompute)."""
    cols: List[str] = []
    rows: Dict[Tuple[str, str], Dict[str, Tuple[str, str]]] = {}
    for label, out in zip(block.labels, outs):
        seq, c, col = label.split("|")
        if col not in cols:
            cols.append(col)
        peak, _, comm = _memory_row(out)
        rows.setdefault((seq, c), {})[col] = (peak, comm)
    cols = [name for name, _ in _CP_COLS if name in cols]  # the registry's column order
    wire = ("TSP8×C", "TP8+SP×C")
    head = ["S", "C", "GPUs", *cols, f"received GB / step {wire[0]} / {wire[1]}"]
    lines = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for (seq, c), cells in rows.items():
        peaks = [f"{float(cells[k][0]):.1f}" if k in cells else "-" for k in cols]
        comm = [f"{float(cells[k][1]):.0f}" if k in cells else "-" for k in wire]
        received = " / ".join(comm) if any(x != "-" for x in comm) else "-"
        lines.append(f"| {seq} | {c} | {8 * int(c)} | " + " | ".join(peaks) + f" | {received} |")
    return "\n".join(lines)


def vocab_ring_sentence(block: Block, outs: List[str]) -> str:
    """``memory`` at 7B/128k: TSP with the vocabulary ring (auto), TSP with Megatron's output
    layer (never), TP+SP; the bytes received per step, and TSP's as a multiple of TP+SP's."""
    ring, never, tpsp = (float(_memory_row(o)[2]) for o in outs)
    peak_ring, peak_never = (float(_memory_row(o)[0]) for o in outs[:2])
    return (
        f"the step receives {ring:.1f} GB ({ring / tpsp:.3f}× TP+SP's {tpsp:.1f}) instead of "
        f"{never:.1f} ({never / tpsp:.3f}×) with Megatron's output layer, and peaks at "
        f"{peak_ring:.1f} instead of {peak_never:.1f} GB"
    )


def _plan_rows(out: str) -> Dict[str, List[str]]:
    """plan's table: {strategy: its whitespace-split row}."""
    lines = out.splitlines()
    head = next(i for i, x in enumerate(lines) if x.startswith("strategy"))
    rows = {}
    for line in lines[head + 2 :]:
        if not line.strip() or line.startswith(" "):
            break
        rows[line.split()[0]] = line.split()
    return rows


def _layer_ms(row: List[str]) -> float:
    """Per-layer time of a plan row: compute + exposed communication, forward + backward."""
    compute, exposed = (sum(float(x) for x in row[k].split("/")) for k in (6, 8))
    return compute + exposed


def tsp_settings(block: Block, outs: List[str]) -> str:
    """plan without recompute under TSP's fc1 recompute, attention recompute and both; TSP's
    full-recompute peak and TP+SP's without recompute (from the first command)."""
    fc1, attn, both = (_plan_rows(o) for o in outs)
    mem = lambda row, k: row[2].split("/")[k]  # noqa: E731
    tsp, tp = fc1["TSP8"], fc1["TP8+SP"]
    return (
        f"the opt-in fc1 recompute (`--tsp-recompute-fc1`, the default before issue 19) "
        f"{mem(tsp, 0)} GB / {_layer_ms(tsp):.1f} ms; attention recompute {mem(attn['TSP8'], 0)} "
        f"GB / {_layer_ms(attn['TSP8']):.1f} ms ({mem(both['TSP8'], 0)} GB with both), full "
        f"recompute {mem(tsp, 1)} GB. TP+SP without recompute ({_layer_ms(tp):.1f} ms) needs "
        f"{mem(tp, 0)} GB"
    )


def received_ratio_table(block: Block, outs: List[str]) -> str:
    """One row per ``memory`` command: GB received per rank per step and its ratio to the last
    command's (the reference row)."""
    comms = [float(_memory_row(o)[2]) for o in outs]
    rows = ["| | GB received | / TP+SP |", "|---|---:|---:|"]
    for k, (label, comm) in enumerate(zip(block.labels, comms)):
        ratio = f"{comm / comms[-1]:.3f}" if k < len(comms) - 1 else "1"
        rows.append(f"| {label} | {comm:.1f} | {ratio} |")
    return "\n".join(rows)


def planned_vs_measured(block: Block, outs: List[str]) -> str:
    """plan's analytic peak without recompute (first row of its table) against ``memory``'s."""
    lines = outs[0].splitlines()
    head = next(i for i, x in enumerate(lines) if x.startswith("strategy"))
    planned = float(re.search(r"([\d.]+)/[\d.]+", lines[head + 2]).group(1))
    measured = float(_memory_row(outs[1])[0])
    return (
        f"{planned:.1f} GB planned vs {measured:.2f} GB measured "
        f"({(planned - measured) / measured * 100:+.1f}%)"
    )


_VALIDATE = re.compile(r"MemTracker peak (\d+) B, real-tensor run's CPU-allocator peak (\d+) B")


def validate_table(block: Block, outs: List[str]) -> str:
    """``memory --validate``: the fake-tensor and the real allocator's peaks (MB = 1e6 B) and the
    signed error of the fake one."""
    rows = ["| scheme | fake MemTracker | real allocator | error |", "|---|---:|---:|---:|"]
    for label, out in zip(block.labels, outs):
        fake, real = (int(x) for x in _VALIDATE.search(out).groups())
        err = (fake - real) / real * 100
        sign = "−" if err < 0 else "+"
        rows.append(
            f"| {label} | {fake / 1e6:.2f} MB | {real / 1e6:.2f} MB | {sign}{abs(err):.2f}% |"
        )
    return "\n".join(rows)


# ------------------------------------------------------------------------------------------------
# the registry

_PLAN_CP = (
    f"{PROG} plan --model {{m}} --hardware h100 --seq-length 1048576 --gpus {{n}} "
    "--strategies tsp_cp,tsp_cp_ring,tp_cp --cp 2,4,8,16,32,64,128 --compute-model flops"
)
_GPUS = (64, 128, 256, 512, 1024)
_M7 = f"{PROG} memory --model 7b"
_1M = "--seq 1048576"
_ONE_M_ROWS = [
    ("TSP8×CP8", f"{_M7} --scheme tsp --tp 8 --cp 8 --world-size 64 {_1M}"),
    ("TP8+SP×CP8", f"{_M7} --scheme tp_cp --tp 8 --cp 8 --world-size 64 {_1M}"),
    ("TP8+SP×CP16", f"{_M7} --scheme tp_cp --tp 8 --cp 16 --world-size 128 {_1M}"),
    (
        "TSP8×CP2, full recompute",
        f"{_M7} --scheme tsp --tp 8 --cp 2 --world-size 16 {_1M} --recompute full",
    ),
    (
        "TP8+SP×CP2, full recompute",
        f"{_M7} --scheme tp_cp --tp 8 --cp 2 --world-size 16 {_1M} --recompute full",
    ),
]
_A2A = " --tsp-kv-grad-all-to-all"
_A2A_ROWS = [
    ("128k, TSP8", f"{_M7} --scheme tsp --tp 8 --seq 131072"),
    ("128k, TSP8, all-to-all", f"{_M7} --scheme tsp --tp 8 --seq 131072" + _A2A),
    ("1M, TSP8×CP8", _ONE_M_ROWS[0][1]),
    ("1M, TSP8×CP8, all-to-all", _ONE_M_ROWS[0][1] + _A2A),
    ("1M, TSP8×CP2, full recompute", _ONE_M_ROWS[3][1]),
    ("1M, TSP8×CP2, full recompute, all-to-all", _ONE_M_ROWS[3][1] + _A2A),
]
_128K = f"{_M7} --tp 8 --seq 131072"
_TSP_MLP_ROWS = [
    ("TP8+SP", f"{_128K} --scheme tp_sp"),
    ("TP8+SP + TSP MLP (`--tsp-mlp`)", f"{_128K} --scheme hybrid"),
    ("TP8+SP + TSP MLP, fc1 recompute", f"{_128K} --scheme hybrid --tsp-recompute-fc1"),
]
_KV_FP32_ROWS = [
    ("TSP8", _A2A_ROWS[0][1]),
    ("TSP8, `--tsp-kv-grad-reduce-in-fp32`", _A2A_ROWS[0][1] + " --tsp-kv-grad-reduce-in-fp32"),
    ("TP8+SP", _TSP_MLP_ROWS[0][1]),
]
_MOE_PLAN = [
    f"{PROG} plan --model {m} --hardware h100 --gpus 64 --seq-length {n}"
    for m in ("mixtral-8x7b", "deepseek-v2-lite")
    for n in (32768, 131072)
]
_VAL = f"{PROG} memory --validate --model small --tp 4 --world-size 4 --seq 2048"
_VALIDATE_ROWS = [
    ("TSP D=4", f"{_VAL} --scheme tsp"),
    ("TP=4+SP", f"{_VAL} --scheme tp_sp"),
    ("TP=4", f"{_VAL} --scheme tp"),
    (
        "TP2×CP2",
        f"{PROG} memory --validate --model small --tp 2 --cp 2 --world-size 4 --seq 2048 "
        "--scheme tp_cp",
    ),
    ("TSP D=4, full recompute", f"{_VAL} --scheme tsp --recompute full"),
]
_CP_COLS = [
    ("TSP8×C", "--scheme tsp"),
    ("TSP8×C attn. recompute", "--scheme tsp --tsp-attention-backward recompute"),
    ("TP8+SP×C", "--scheme tp_cp"),
    ("TSP8×C full recompute", "--scheme tsp --recompute full"),
    ("TP8+SP×C full recompute", "--scheme tp_cp --recompute full"),
]
_SEQ = {"1M": 1048576, "512k": 524288}


def _cp_rows(model, cells):
    """[(label "S|C|layout", memory command)] for each (S, C, layout indices)."""
    rows = []
    for seq, c, cols in cells:
        for name, flags in (_CP_COLS[i] for i in cols):
            scheme = flags.split()[1]
            if c == 1 and scheme == "tp_cp":
                scheme = "tp_sp"  # no CP: Megatron's TP+SP
            extra = flags.split(maxsplit=2)[2] if len(flags.split()) > 2 else ""
            cmd = f"{PROG} memory --model {model} --scheme {scheme} --tp 8"
            cmd += f" --cp {c} --world-size {8 * c}" if c > 1 else " --world-size 8"
            cmd += f" --seq {_SEQ[seq]}" + (f" {extra}" if extra else "")
            rows.append((f"{seq}|{c}|{name}", cmd))
    return rows


_FULL, _ALL, _NO_RC = (3, 4), (0, 1, 2, 3, 4), (0, 2)
_CP_7B = _cp_rows(
    "7b",
    [("1M", 1, _FULL), ("1M", 2, _FULL), ("1M", 8, _ALL), ("1M", 16, _NO_RC), ("512k", 8, _NO_RC)],
)
_CP_LLAMA = _cp_rows("llama3-8b", [("1M", 4, _FULL), ("1M", 8, _NO_RC), ("1M", 16, _NO_RC)])
_NEVER = " --tsp-vocab-ring never"
_VOCAB_RING = [
    _A2A_ROWS[0][1],
    _A2A_ROWS[0][1] + _NEVER,
    _TSP_MLP_ROWS[0][1],
]
# Prepared, not registered yet (each needs its doc's markers and the full-scale runs; see
# issue 35 item 4): docs/memory.md's 7B table (_MEMORY_7B, memory_flops_table, 19 runs), the 128k
# bytes of docs/precision.md (_WIRE_ROWS, received_ratio_table) and the vocabulary ring's bytes
# in docs/design.md / docs/megatron-lm.md (_VOCAB_RING, vocab_ring_sentence).
_16K = f"{_M7} --tp 8 --seq 16384"
_FR = " --recompute full"
_ATT = " --tsp-attention-backward recompute"
_CP8 = f"{_M7} --world-size 8 --seq 131072 --scheme tp_cp"
_MEMORY_7B = [
    ("TSP D=8", f"{_16K} --scheme tsp"),
    ("TSP D=8", f"{_16K} --scheme tsp{_FR}"),
    ("TP=8", f"{_16K} --scheme tp"),
    ("TP=8", f"{_16K} --scheme tp{_FR}"),
    ("TP=8 + SP", f"{_16K} --scheme tp_sp"),
    ("TP=8 + SP", f"{_16K} --scheme tp_sp{_FR}"),
    ("TP=8 + SP + TSP MLP", f"{_16K} --scheme hybrid"),
    ("TP=8", f"{_128K} --scheme tp"),
    ("TP=8", f"{_128K} --scheme tp{_FR}"),
    ("TP=8 + SP", _TSP_MLP_ROWS[0][1]),
    ("TP=8 + SP", _TSP_MLP_ROWS[0][1] + _FR),
    ("TP=8 + SP + TSP MLP (`--tsp-mlp`)", _TSP_MLP_ROWS[1][1]),
    ("TP=8 + SP + TSP MLP, fc1 recompute ⁴", _TSP_MLP_ROWS[2][1]),
    ("TP4 × CP2 (+SP) ²", f"{_CP8} --tp 4 --cp 2"),
    ("TP4 × CP2 (+SP) ²", f"{_CP8} --tp 4 --cp 2{_FR}"),
    ("TP2 × CP4 (+SP) ²", f"{_CP8} --tp 2 --cp 4"),
    ("TSP D=8", _A2A_ROWS[0][1]),
    ("TSP D=8, attention recompute ¹", _A2A_ROWS[0][1] + _ATT),
    ("TSP D=8, attention + fc1 recompute ¹ ⁴", _A2A_ROWS[0][1] + _ATT + " --tsp-recompute-fc1"),
]
_MOE_MEMORY = [
    f"{PROG} memory --model {m} --table --seqs 131072" for m in ("mixtral-8x7b", "deepseek-v2-lite")
]
_TSP_RECOMPUTE = (
    "--tsp-recompute-fc1",
    "--tsp-recompute-attn",
    "--tsp-recompute-fc1 --tsp-recompute-attn",
)
_WIRE_ROWS = [
    (
        "TSP, bf16 dK/dV wire, vocabulary ring (default: `--tsp-vocab-ring auto` takes it at 128k)",
        _A2A_ROWS[0][1],
    ),
    ("TSP, bf16 dK/dV wire, Megatron's output layer (`--tsp-vocab-ring never`)", _VOCAB_RING[1]),
    ("TSP, fp32 dK/dV wire, vocabulary ring", _KV_FP32_ROWS[1][1]),
    ("TSP, fp32 dK/dV wire, Megatron's output layer", _KV_FP32_ROWS[1][1] + _NEVER),
    ("TP=8 + SP", _TSP_MLP_ROWS[0][1]),
]
_LAYER_TIME = (
    f"{PROG} plan --model 7b --hardware h100 --seq-length 131072 --gpus 8 "
    "--no-distributed-optimizer"
)


def _rows(block_rows):
    return dict(labels=[r[0] for r in block_rows], commands=[r[1] for r in block_rows])


def compare_part(block: Block, outs: List[str]) -> str:
    """compare's markdown: its table (``labels`` ["table"]) or the summary printed after it
    (["summary"]), so both blocks share one run."""
    from megatron_tsp.tools.estimator.compare_table import SUMMARY_HEAD

    text = outs[0].strip("\n")
    i = text.index("\n" + SUMMARY_HEAD)
    part = text[:i] if block.labels == ["table"] else text[i + 1 :]
    return "\n".join(x.rstrip() for x in part.strip("\n").splitlines())


_COMPARE = f"{PROG} compare --hardware h100"


def plan_tables(block: Block, outs: List[str]) -> str:
    """plan's strategy table (header and rows, without the crossover lines) of each command, as
    one code block."""
    tables = []
    for out in outs:
        lines = [x.rstrip() for x in out.splitlines()]
        head = next(i for i, x in enumerate(lines) if x.startswith("strategy"))
        tables.append("\n".join(lines[head : lines.index("", head)]))
    return "```\n" + "\n\n".join(tables) + "\n```"


_DOCUMENT_BALANCE = (
    f"{PROG} documents --documents uniform:1k-32k --documents heavy:0.7,256-128k --documents "
    "long+short:96k,1k-4k --seq-length 131072 --degree 8 --draws 16 --layouts "
    "zigzag,thd,chunks-2,chunks-4,chunks-8,split-4k,split-16k"
)

_TRAFFIC_DOCUMENTS = f"{PROG} bench --traffic --seq-lengths 32768 --documents uniform:1k-32k"


def traffic_documents(block: Block, outs: List[str]) -> str:
    """bench --traffic --documents' packed-documents table and its per-rank pairs lines."""
    lines = outs[0].splitlines()
    balance = [x.rstrip() for x in lines if "in-document pairs per rank" in x]
    return "\n".join(_section(outs[0], "| scheme | documents") + [""] + balance)


BLOCKS: List[Block] = [
    Block("README.md", "readme-1m", scale="full", format=memory_table, **_rows(_ONE_M_ROWS)),
    Block("README.md", "readme-tsp-mlp", scale="full", format=memory_table, **_rows(_TSP_MLP_ROWS)),
    Block("README.md", "readme-1m-plan", [_PLAN_CP.format(m="7b", n=64)], "small", tsp_cp_table),
    Block("README.md", "readme-layer-time", [_LAYER_TIME], "small", layer_time_sentence),
    Block(
        "docs/megatron-lm.md", "kv-grad-a2a", scale="full", format=memory_table, **_rows(_A2A_ROWS)
    ),
    Block(
        "docs/megatron-lm.md",
        "kv-grad-fp32",
        scale="full",
        format=memory_table,
        **_rows(_KV_FP32_ROWS),
    ),
    Block("docs/megatron-lm.md", "cp-7b", scale="full", format=cp_pivot, **_rows(_CP_7B)),
    Block("docs/megatron-lm.md", "cp-llama", scale="full", format=cp_pivot, **_rows(_CP_LLAMA)),
    Block("docs/planner.md", "layer-time", [_LAYER_TIME], "small", layer_time),
    Block(
        "docs/planner.md",
        "hybrid-h200",
        [f"{PROG} plan --model 7b --hardware h200 --gpus 8 --seq-length 131072"],
        "small",
        plan_excerpt,
        labels=["TSP8", "TP8+SP", "TP8+SP+TSP-MLP"],
    ),
    Block(
        "docs/planner.md",
        "tsp-settings",
        [f"{_LAYER_TIME} --strategies tsp,tp_sp --recompute none {x}" for x in _TSP_RECOMPUTE],
        "small",
        tsp_settings,
    ),
    Block(
        "docs/planner.md",
        "tsp-cp-planned",
        [
            f"{PROG} plan --model 7b --hardware h100 --seq-length 1048576 --gpus 64 "
            "--strategies tsp_cp --cp 8 --no-distributed-optimizer",
            _ONE_M_ROWS[0][1],
        ],
        "full",
        planned_vs_measured,
    ),
    Block(
        "docs/planner.md",
        "tsp-cp-7b",
        [_PLAN_CP.format(m="7b", n=n) for n in _GPUS],
        "small",
        tsp_cp_table,
    ),
    Block(
        "docs/planner.md",
        "tsp-cp-llama",
        [_PLAN_CP.format(m="llama3-8b", n=n) for n in _GPUS],
        "small",
        tsp_cp_table,
    ),
    Block(
        "docs/moe.md",
        "moe-mixtral",
        [f"{PROG} moe --model mixtral-8x7b --seq-lengths 32768,131072,1048576"],
        "small",
        verbatim,
    ),
    Block(
        "docs/moe.md",
        "moe-deepseek",
        [f"{PROG} moe --model deepseek-v2-lite --seq-lengths 32768,131072,1048576"],
        "small",
        verbatim,
    ),
    Block("docs/moe.md", "moe-plan", _MOE_PLAN, "small", moe_plan_table),
    Block("docs/moe.md", "moe-memory", _MOE_MEMORY, "full", moe_memory_table),
    Block(
        "docs/memory.md", "validate", scale="full", format=validate_table, **_rows(_VALIDATE_ROWS)
    ),
    Block(
        "docs/planner.md",
        "fsdp-gtp",
        [
            f"{PROG} plan --model 7b --hardware h100 --gpus 8 --seq-length 131072 --strategies "
            "tsp,tp_sp,fsdp_cp,fsdp_cp_ring,gtp,gtp_mxfp8,gtp_nvfp4 --compute-model flops",
            f"{PROG} plan --model llama2-70b --hardware h100 --gpus 64 --seq-length 131072 "
            "--strategies tsp,tp_sp,tsp_cp,tp_cp,fsdp_cp,fsdp_cp_ring,gtp,gtp_mxfp8,gtp_nvfp4 "
            "--cp 8 --compute-model flops",
        ],
        "small",
        plan_tables,
    ),
    Block("docs/design.md", "document-balance", [_DOCUMENT_BALANCE], "small", verbatim),
    Block("docs/benchmark.md", "compare", [_COMPARE], "full", compare_part, labels=["table"]),
    # a fake-tensor recording of one 7B layer per scheme: ~15 s
    Block(
        "docs/benchmark.md",
        "traffic-documents",
        [_TRAFFIC_DOCUMENTS],
        "full",
        traffic_documents,
    ),
    Block("README.md", "readme-compare", [_COMPARE], "full", compare_part, labels=["summary"]),
]


# ------------------------------------------------------------------------------------------------
# markers


def opening(block: Block) -> str:
    return (
        f"<!-- generated ({block.id}) by scripts/docs_numbers.py from:\n"
        + "\n".join(block.commands)
        + "\n-->"
    )


def closing(block: Block) -> str:
    return f"<!-- end generated ({block.id}) -->"


def find(text: str, block: Block) -> Tuple[int, int]:
    """(start, end) of the block in ``text``, markers included."""
    start = text.find(f"<!-- generated ({block.id}) ")
    end_marker = closing(block)
    end = text.find(end_marker, start)
    if start < 0 or end < 0:
        raise KeyError(f"{block.file}: no block {block.id!r} (markers missing)")
    return start, end + len(end_marker)


def render(block: Block, outs: List[str]) -> str:
    return f"{opening(block)}\n{block.format(block, outs)}\n{closing(block)}"


# ------------------------------------------------------------------------------------------------
# running the commands


def _argv(command: str) -> List[str]:
    argv = shlex.split(command)
    if argv[0] != PROG:
        raise ValueError(f"not a {PROG} command: {command}")
    return argv[1:]


def run_command(command: str) -> str:
    """The command's stdout; plan / moe in this process, the rest in a fresh one."""
    argv = _argv(command)
    if argv[0] in IN_PROCESS:
        from megatron_tsp.tools import cli

        buf = io.StringIO()
        with contextlib.redirect_stdout(buf), open(os.devnull, "w") as null:
            with contextlib.redirect_stderr(null):
                rc = cli.main(argv)
        if rc:
            raise RuntimeError(f"{command}: exit {rc}")
        return buf.getvalue()
    proc = subprocess.run(
        [sys.executable, "-m", "megatron_tsp.tools.cli", *argv],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    if proc.returncode:
        raise RuntimeError(f"{command}: exit {proc.returncode}\n{proc.stderr[-2000:]}")
    return proc.stdout


class _Parsed(Exception):
    pass


def parse_only(command: str) -> None:
    """Run ``command`` through the CLI up to its argument parsing and checks, then stop: raises
    ``SystemExit`` (argparse's status 2) where the CLI rejects it."""
    from megatron_tsp.console import args as cli_args
    from megatron_tsp.tools import cli

    base_parse = argparse.ArgumentParser.parse_args
    tool_parse = cli_args.ToolParser.parse_args

    def plain(self, args=None, namespace=None):
        ns = base_parse(self, args, namespace)
        if isinstance(self, cli_args.ToolParser):  # called by ToolParser.parse_args: checks next
            return ns
        raise _Parsed

    def tool(self, args=None, namespace=None):
        tool_parse(self, args, namespace)
        raise _Parsed

    argparse.ArgumentParser.parse_args = plain
    cli_args.ToolParser.parse_args = tool
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            rc = cli.main(_argv(command))
        raise SystemExit(rc or "the command ran without parsing its arguments")
    except _Parsed:
        return
    finally:
        argparse.ArgumentParser.parse_args = base_parse
        cli_args.ToolParser.parse_args = tool_parse


def selected(scale: str, only: Sequence[str] = ()) -> List[Block]:
    return [
        b for b in BLOCKS if (scale == "all" or b.scale == scale) and (not only or b.id in only)
    ]


def generate(blocks: Sequence[Block], log=None, cache_file: str = "") -> Dict[str, str]:
    """{block id: rendered block}; a command shared by blocks runs once. ``cache_file``: a JSON
    {command: stdout} read first and written after each command (to --write what --show ran)."""
    cache: Dict[str, str] = {}
    if cache_file and os.path.exists(cache_file):
        with open(cache_file) as f:
            cache = json.load(f)
    texts = {}
    for b in blocks:
        outs = []
        for c in b.commands:
            if c not in cache:
                if log:
                    log(f"running: {c}")
                cache[c] = run_command(c)
                if cache_file:
                    with open(cache_file, "w") as f:
                        json.dump(cache, f, indent=1)
            outs.append(cache[c])
        texts[b.id] = render(b, outs)
    return texts


def compare(blocks: Sequence[Block], texts: Dict[str, str], root: str = ROOT) -> List[str]:
    """A unified diff per block whose text in its file differs from ``texts``."""
    problems = []
    for b in blocks:
        with open(os.path.join(root, b.file)) as f:
            doc = f.read()
        try:
            start, end = find(doc, b)
        except KeyError as exc:
            problems.append(str(exc))
            continue
        have = doc[start:end]
        if have != texts[b.id]:
            diff = difflib.unified_diff(
                have.splitlines(),
                texts[b.id].splitlines(),
                f"{b.file} ({b.id})",
                "generated",
                lineterm="",
            )
            problems.append("\n".join(diff))
    return problems


def write(blocks: Sequence[Block], texts: Dict[str, str], root: str = ROOT) -> List[str]:
    changed = []
    for b in blocks:
        path = os.path.join(root, b.file)
        with open(path) as f:
            doc = f.read()
        start, end = find(doc, b)
        if doc[start:end] != texts[b.id]:
            with open(path, "w") as f:
                f.write(doc[:start] + texts[b.id] + doc[end:])
            changed.append(f"{b.file} ({b.id})")
    return changed


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true", help="exit 1 if a block differs")
    mode.add_argument("--write", action="store_true", help="rewrite the blocks")
    mode.add_argument("--parse", action="store_true", help="only parse every block's commands")
    mode.add_argument("--show", action="store_true", help="print the generated blocks")
    p.add_argument("--scale", choices=("small", "full", "all"), default="small")
    p.add_argument("--only", action="append", default=[], help="block id (repeatable)")
    p.add_argument("--cache", default="", help="JSON file of the commands' stdout, reused")
    args = p.parse_args(argv)
    blocks = selected(args.scale, args.only)
    if args.parse:
        for b in blocks:
            for c in b.commands:
                parse_only(c)
        print(f"{sum(len(b.commands) for b in blocks)} commands parse")
        return 0
    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    texts = generate(blocks, log=log, cache_file=args.cache)
    if args.show:
        print("\n\n".join(texts.values()))
        return 0
    if args.write:
        changed = write(blocks, texts)
        print("rewritten: " + (", ".join(changed) or "nothing"))
        return 0
    problems = compare(blocks, texts)
    for x in problems:
        print(x)
    print(f"{len(problems)} of {len(blocks)} generated blocks differ")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
