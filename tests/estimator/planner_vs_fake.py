"""Run in a subprocess by test_planner_memory.py: the fake-tensor tool (``fake_run.run_step``)
and the planner's ``analytic_memory`` on the same layouts; prints one JSON line."""

import json
import sys
import warnings

warnings.filterwarnings("ignore")

from megatron_tsp.core.model_shape import ModelShape  # noqa: E402
from megatron_tsp.tools.estimator import planner as pl  # noqa: E402
from tests.estimator.planner_check import RESULT, compare  # noqa: E402


def layouts(d):
    """(name, scheme for the fake tool, kind for the planner, TP, CP, recompute, TSP attention
    backward) for a group of ``d`` ranks."""
    return [
        ("tsp", "tsp", "tsp", d, 1, "none", "saved"),
        ("tsp-attn-recompute", "tsp", "tsp", d, 1, "none", "recompute"),
        ("tp_sp", "tp_sp", "tp_sp", d, 1, "none", None),
        ("tpsp-full", "tp_sp", "tp_sp", d, 1, "full", None),
        ("tsp-full", "tsp", "tsp", d, 1, "full", "saved"),
        ("tpcp", "tp_cp", "tp_cp", d // 2, 2, "none", None),
        # TSP x CP (``--scheme tsp --cp C``): TSP of d/2 and of d, times CP 2
        ("tspcp", "tsp", "tsp_cp", d // 2, 2, "none", "saved"),
        ("tspcp-attn-recompute", "tsp", "tsp_cp", d // 2, 2, "none", "recompute"),
        ("tspcp-full", "tsp", "tsp_cp", d // 2, 2, "full", "saved"),
        ("tspcp-d", "tsp", "tsp_cp", d, 2, "none", "saved"),
        ("tspcp-d-attn-recompute", "tsp", "tsp_cp", d, 2, "none", "recompute"),
        ("tspcp-d-full", "tsp", "tsp_cp", d, 2, "full", "saved"),
    ]


def main(hidden, layers, heads, vocab, seq, d, which, groups=None):
    shape = ModelShape(
        name="check",
        hidden=hidden,
        num_layers=layers,
        heads=heads,
        query_groups=groups,
        vocab=vocab,
    )
    out = []
    for name, scheme, kind, tp, cp, recompute, attn in layouts(d):
        if which and name not in which:
            continue
        options = pl.Options(tsp_recompute_attn=attn == "recompute", attn_kernel="cpu_flash")
        row = compare(
            shape, seq, scheme, kind, tp, cp, recompute, options, tsp_attention_backward=attn
        )
        row["layout"] += f" attn={attn}" if attn else ""
        out.append(row)
    print(RESULT + json.dumps(out))


if __name__ == "__main__":
    args = [int(a) for a in sys.argv[1:7]]
    which = sys.argv[7].split(",") if len(sys.argv) > 7 and sys.argv[7] != "all" else []
    main(*args, which=which, groups=int(sys.argv[8]) if len(sys.argv) > 8 else None)
