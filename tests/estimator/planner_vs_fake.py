"""Run in a subprocess by test_planner_memory.py: the fake-tensor tool (``fake_run.run_step``)
and the planner's ``analytic_memory`` on the same layouts; prints one JSON line."""

import json
import sys
import warnings

warnings.filterwarnings("ignore")

from megatron_tsp.estimator import fake_run as fr  # noqa: E402
from megatron_tsp.estimator import planner as pl  # noqa: E402

# scheme (fake tool), kind (planner), TP, CP, recompute, TSP attention backward
LAYOUTS = [
    ("tsp", "tsp", 4, 1, "none", "saved"),
    ("tsp", "tsp", 4, 1, "none", "recompute"),
    ("tpsp", "tp_sp", 4, 1, "none", None),
    ("tpsp", "tp_sp", 4, 1, "full", None),
    ("tsp", "tsp", 4, 1, "full", "saved"),
    ("cp", "tp_cp", 2, 2, "none", None),
]


def main(hidden, layers, heads, vocab, seq, which):
    shape = fr.ModelShape(hidden=hidden, layers=layers, heads=heads, vocab=vocab)
    spec = pl.ModelSpec(name="check", hidden=hidden, num_layers=layers, heads=heads,
                        query_groups=heads, ffn=4 * hidden, vocab=vocab)
    out = []
    for scheme, kind, tp, cp, recompute, attn in LAYOUTS:
        if which and scheme + ":" + recompute not in which:
            continue
        measured = fr.run_step(fr.RunConfig(
            scheme=scheme, model=shape, world_size=tp * cp, tp=tp, cp=cp, seq=seq,
            recompute=recompute, count_flops=False, count_comm=False,
            tsp_attention_backward=attn))
        planned = pl.analytic_memory(
            spec, pl.Strategy(kind, tp=tp, cp=cp), seq, recompute=recompute,
            distributed_optimizer=False,
            options=pl.Options(tsp_recompute_attn=attn == "recompute"))
        out.append({"layout": f"{measured.label} {recompute}" + (f" attn={attn}" if attn else ""),
                    "measured": measured.peak_bytes, "planned": sum(planned.values()),
                    "measured_phase": measured.peak_phase,
                    "measured_by_category": measured.peak_breakdown,
                    "planned_by_category": planned})
    print("@@RESULT@@" + json.dumps(out))


if __name__ == "__main__":
    args = [int(a) for a in sys.argv[1:6]]
    main(*args, which=sys.argv[6].split(",") if len(sys.argv) > 6 else [])
