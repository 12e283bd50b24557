#!/usr/bin/env python
"""HBM bytes of one rank's layer step, measured by the GPU's counters, beside the traffic model.

``megatron-tsp bench --traffic`` counts the bytes each aten op reads and writes on shape-only
tensors (``megatron_tsp/tools/traffic.py``); this script checks that count against the DRAM
counters of a real GPU for the very same step:

    # on the GPU, once per scheme, under Nsight Compute:
    ncu --profile-from-start off --clock-control none --print-units base --csv \\
        --metrics dram__bytes_read.sum,dram__bytes_write.sum,gpu__time_duration.sum \\
        --log-file DIR/ncu_tsp.csv  python scripts/hbm_check.py step --scheme tsp --out DIR
    # anywhere:
    python scripts/hbm_check.py report --dir DIR      # DIR/hbm_check.md and DIR/hbm_check.json

``step`` builds the layer exactly as ``scripts/gpu_check.py`` times it (real layer specs, rank 0
of a ``fake`` process group of D ranks, bf16), runs one warm-up step (persistent buffers, kernel
autotuning), one step under the traffic recorder (the model's count, written to
``DIR/counted_<scheme>.json``), and one step between ``cudaProfilerStart`` / ``cudaProfilerStop``
that ncu measures kernel by kernel. ncu flushes the caches before each kernel (its default), so a
kernel's DRAM bytes are what it moves with a cold L2: the traffic model's "every tensor argument
read, every result written" is that same cold-cache figure, which is why the two are compared.

``step --cpu-smoke`` runs the same path at tiny shapes on CPU without the profiler (the test
suite); ``report`` reads ncu's CSV (``--csv``, long format: one row per kernel and metric).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import warnings
from typing import Dict, List

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for path in (REPO, os.path.join(REPO, "scripts")):
    if path not in sys.path:
        sys.path.insert(0, path)

SCHEMES = ("tsp", "tp_sp")
LABELS = {"tsp": "TSP", "tp_sp": "Megatron TP+SP"}
METRICS = {
    "dram__bytes_read.sum": "read",
    "dram__bytes_write.sum": "written",
    "gpu__time_duration.sum": "time",
}
# ncu prints a unit beside each value; --print-units base asks for bytes and nanoseconds, but
# other settings scale them, so every unit ncu can print for these metrics is understood.
UNIT_SCALE = {
    "byte": 1.0,
    "kbyte": 1e3,
    "mbyte": 1e6,
    "gbyte": 1e9,
    "tbyte": 1e12,
    "ns": 1e-9,  # what ncu 2025.3 prints for gpu__time_duration.sum
    "us": 1e-6,
    "ms": 1e-3,
    "s": 1.0,
    "nsecond": 1e-9,
    "usecond": 1e-6,
    "msecond": 1e-3,
    "second": 1.0,
}


# --------------------------------------------------------------------------------------------
# step: on the GPU, under ncu


def run_step(scheme: str, d: int, seq: int, out_dir: str, cpu_smoke: bool) -> dict:
    import gpu_check as gc
    import torch

    from megatron_tsp.core.comm import WORKSPACE
    from megatron_tsp.tools import traffic

    if not cpu_smoke and not torch.cuda.is_available():
        raise SystemExit("hbm_check step: no CUDA device (use --cpu-smoke on a CPU machine)")
    device, model = gc.device_and_model(cpu_smoke)
    problems = gc.layout_problems(model, seq, d)
    if problems:
        raise SystemExit("hbm_check step: " + "; ".join(problems))
    if cpu_smoke:
        from megatron_tsp.megatron_lm.cpu_support import enable_cpu_support

        enable_cpu_support()
    WORKSPACE.clear()
    gc.setup_groups(scheme, d, model, seq)
    layer, freqs = gc.build_layer(scheme, d, model, seq, torch.bfloat16, device, init=False)
    x, dy = gc.layer_inputs(d, model, seq, torch.bfloat16, device)
    gc.layer_step(layer, x, dy, freqs)  # warm-up: persistent buffers, autotuning
    layer.zero_grad(set_to_none=True)
    recorder = traffic.make_recorder(device_type=device)
    with recorder:
        gc.layer_step(layer, x, dy, freqs)
    counted = traffic.summarize(recorder.records, top=12)
    layer.zero_grad(set_to_none=True)
    gc._sync(device)
    if device == "cuda":
        torch.cuda.profiler.start()
    gc.layer_step(layer, x, dy, freqs)
    gc._sync(device)
    if device == "cuda":
        torch.cuda.profiler.stop()
    result = {
        "scheme": scheme,
        "d": d,
        "seq": seq,
        "device": device,
        "hidden": model.hidden,
        "heads": model.heads,
        "ffn": model.ffn_hidden,
        "attention_kernel": getattr(layer.self_attention, "attention_kernel_name", None),
        "counted": {k: v for k, v in counted.items() if k != "records"},
    }
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, f"counted_{scheme}.json"), "w") as f:
        json.dump(result, f, indent=1)
    return result


# --------------------------------------------------------------------------------------------
# report: anywhere


def _number(text: str) -> float:
    return float(text.replace(",", "").strip() or "nan")


def parse_ncu_csv(path: str) -> List[Dict[str, object]]:
    """One entry per profiled kernel, in launch order: name, bytes read / written, time (s).
    ncu's log may hold ``==PROF==`` lines before the CSV header; they are skipped."""
    with open(path, newline="") as f:
        lines = [line for line in f if not line.startswith("==")]
    kernels: Dict[str, Dict[str, object]] = {}
    for row in csv.DictReader(lines):
        metric = METRICS.get(row.get("Metric Name", ""))
        if metric is None:
            continue
        unit = (row.get("Metric Unit") or "").strip().lower()
        if unit not in UNIT_SCALE:
            raise ValueError(f"{path}: unit {unit!r} of {row['Metric Name']} is not understood")
        name = next(
            (row[c] for c in ("Kernel Name", "Function Name", "Demangled Name") if row.get(c)), "?"
        )
        entry = kernels.setdefault(row["ID"], {"id": int(row["ID"]), "name": name})
        entry[metric] = _number(row["Metric Value"]) * UNIT_SCALE[unit]
    out = sorted(kernels.values(), key=lambda k: k["id"])
    for k in out:
        missing = [m for m in METRICS.values() if m not in k]
        if missing:
            raise ValueError(f"{path}: kernel {k['id']} ({k['name']}) lacks {missing}")
    return out


def summarize_scheme(kernels: List[Dict[str, object]], counted: dict) -> dict:
    read = sum(k["read"] for k in kernels)
    written = sum(k["written"] for k in kernels)
    by_name: Dict[str, Dict[str, float]] = {}
    for k in kernels:
        e = by_name.setdefault(k["name"], {"launches": 0, "bytes": 0.0, "time_s": 0.0})
        e["launches"] += 1
        e["bytes"] += k["read"] + k["written"]
        e["time_s"] += k["time"]
    top = sorted(({"kernel": n, **v} for n, v in by_name.items()), key=lambda e: -e["bytes"])
    model_bytes = counted["counted"]["bytes"]
    return {
        "kernels_measured": len(kernels),
        "kernels_counted": counted["counted"]["kernels"],
        "dram_read": read,
        "dram_written": written,
        "dram_bytes": read + written,
        "kernel_time_s": sum(k["time"] for k in kernels),
        "model_bytes": model_bytes,
        "dram_over_model": (read + written) / model_bytes if model_bytes else float("nan"),
        "attention_kernel": counted.get("attention_kernel"),
        "top_kernels": top[:10],
    }


def report(directory: str) -> dict:
    schemes = {}
    for scheme in SCHEMES:
        csv_path = os.path.join(directory, f"ncu_{scheme}.csv")
        counted_path = os.path.join(directory, f"counted_{scheme}.json")
        if not (os.path.exists(csv_path) and os.path.exists(counted_path)):
            continue
        with open(counted_path) as f:
            counted = json.load(f)
        schemes[scheme] = summarize_scheme(parse_ncu_csv(csv_path), counted)
        schemes[scheme]["setup"] = {k: counted[k] for k in ("d", "seq", "hidden", "heads")}
    if not schemes:
        raise SystemExit(
            f"hbm_check report: no ncu_<scheme>.csv + counted_<scheme>.json in {directory}"
        )
    result = {"schemes": schemes}
    if len(schemes) == 2:
        result["tsp_over_tp_sp"] = {
            "dram_bytes": schemes["tsp"]["dram_bytes"] / schemes["tp_sp"]["dram_bytes"],
            "model_bytes": schemes["tsp"]["model_bytes"] / schemes["tp_sp"]["model_bytes"],
            "kernels": schemes["tsp"]["kernels_measured"] / schemes["tp_sp"]["kernels_measured"],
        }
    with open(os.path.join(directory, "hbm_check.json"), "w") as f:
        json.dump(result, f, indent=1)
    with open(os.path.join(directory, "hbm_check.md"), "w") as f:
        f.write(render(result))
    return result


def render(result: dict) -> str:
    from gpu_check import markdown_kernel_name

    schemes = result["schemes"]
    any_setup = next(iter(schemes.values()))["setup"]
    lines = [
        "# HBM bytes of one rank's layer step: GPU counters vs the traffic model",
        "",
        f"h={any_setup['hidden']}, {any_setup['heads']} heads, S={any_setup['seq']}, "
        f"D={any_setup['d']}, bf16, forward + backward, rank 0 of a fake group "
        "(collectives are no-ops). DRAM bytes: Nsight Compute `dram__bytes_read.sum` + "
        "`dram__bytes_write.sum` per kernel, caches flushed before each kernel (ncu's default). "
        "Model: `megatron_tsp/tools/traffic.py`'s count of the same step.",
        "",
        "| scheme | kernels (ncu) | kernels (model) | DRAM GB | model GB | DRAM / model "
        "| kernel time (ms, under ncu) | attention kernel |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for scheme, s in schemes.items():
        lines.append(
            f"| {LABELS[scheme]} | {s['kernels_measured']} | {s['kernels_counted']} | "
            f"{s['dram_bytes'] / 1e9:.2f} | {s['model_bytes'] / 1e9:.2f} | "
            f"{s['dram_over_model']:.3f} | {1e3 * s['kernel_time_s']:.1f} | "
            f"{s['attention_kernel'] or '-'} |"
        )
    if "tsp_over_tp_sp" in result:
        r = result["tsp_over_tp_sp"]
        lines += [
            "",
            f"TSP / TP+SP: DRAM bytes {r['dram_bytes']:.3f}, model bytes {r['model_bytes']:.3f}, "
            f"kernels {r['kernels']:.2f}.",
        ]
    for scheme, s in schemes.items():
        lines += [
            "",
            f"## {LABELS[scheme]}: kernels by DRAM bytes",
            "",
            "| kernel | launches | GB | ms |",
            "| --- | ---: | ---: | ---: |",
        ]
        for k in s["top_kernels"]:
            name = markdown_kernel_name(k["kernel"], 90)
            lines.append(
                f"| `{name}` | {k['launches']} | {k['bytes'] / 1e9:.3f} | {1e3 * k['time_s']:.2f} |"
            )
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("step", help="one measured layer step (run it under ncu on a GPU)")
    s.add_argument("--scheme", choices=SCHEMES, required=True)
    s.add_argument("--out", required=True, help="folder for counted_<scheme>.json")
    s.add_argument("--d", type=int, default=None, help="D = TP size (default 8; 2 on CPU)")
    s.add_argument("--seq", type=int, default=None, help="tokens (default 32768; 64 on CPU)")
    s.add_argument("--cpu-smoke", action="store_true", help="tiny shapes on CPU, no profiler")
    r = sub.add_parser("report", help="ncu CSVs + counted JSONs -> hbm_check.md / .json")
    r.add_argument("--dir", required=True)
    args = p.parse_args(argv)
    if args.command == "step":
        if args.d is not None and args.d < 1:
            p.error(f"--d={args.d}: must be at least 1")
        if args.seq is not None and args.seq < 2:
            p.error(f"--seq={args.seq}: must be at least 2")
    return args


def main(argv=None) -> int:
    warnings.filterwarnings("ignore")
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    args = parse_args(argv)
    if args.command == "step":
        d = args.d or (2 if args.cpu_smoke else 8)
        seq = args.seq or (64 if args.cpu_smoke else 32768)
        r = run_step(args.scheme, d, seq, args.out, args.cpu_smoke)
        c = r["counted"]
        print(
            f"[hbm step] {args.scheme}: {c['kernels']} kernels, model {c['bytes'] / 1e9:.3f} GB, "
            f"attention {r['attention_kernel']}",
            flush=True,
        )
    else:
        result = report(args.dir)
        for scheme, s in result["schemes"].items():
            print(
                f"[hbm report] {scheme}: DRAM {s['dram_bytes'] / 1e9:.3f} GB, model "
                f"{s['model_bytes'] / 1e9:.3f} GB, {s['kernels_measured']} kernels measured, "
                f"{s['kernels_counted']} counted"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
