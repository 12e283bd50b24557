"""Run in a subprocess by test_planner_moe.py: the fake-tensor tool (``fake_run.run_step``) and
the planner's ``analytic_memory`` on the same MoE layouts; prints one JSON line."""

import json
import sys
import warnings

warnings.filterwarnings("ignore")

from megatron_tsp.core.model_shape import ModelShape  # noqa: E402
from megatron_tsp.tools.estimator import planner as pl  # noqa: E402
from tests.estimator.planner_check import RESULT, compare  # noqa: E402

# (fake-tool scheme, planner kind, expert schedule, dispatcher, recompute)
LAYOUTS = [
    ("tsp", "tsp", "folded", "alltoall", "none"),
    ("tsp", "tsp", "folded", "allgather", "none"),
    ("tsp", "tsp", "ring", "allgather", "none"),
    ("tp_sp", "tp_sp", "folded", "alltoall", "none"),
    ("tsp", "tsp", "folded", "alltoall", "full"),
    ("tsp", "tsp", "ring", "allgather", "full"),
    ("tp_sp", "tp_sp", "folded", "alltoall", "full"),
]


def main(experts, topk, layers, seq, d, shared):
    # LayerNorm: the planner models a GPU's fused norms; the CPU's torch RMSNorm keeps fp32
    # copies of its input and output that neither models
    shape = ModelShape(
        name="moe-check",
        hidden=512,
        num_layers=layers,
        heads=8,
        vocab=4096,
        gated=True,
        normalization="LayerNorm",
        num_experts=experts,
        moe_topk=topk,
        moe_ffn=1024,
        moe_shared_ffn=shared or None,
        moe_dense_layers=1 if layers > 2 else 0,
    )
    out = []
    for scheme, kind, schedule, dispatcher, recompute in LAYOUTS:
        options = pl.Options(
            attn_kernel="cpu_flash", moe_schedule=schedule, moe_dispatcher=dispatcher
        )
        row = compare(
            shape,
            seq,
            scheme,
            kind,
            d,
            1,
            recompute,
            options,
            moe_schedule=schedule,
            moe_dispatcher=dispatcher,
        )
        out.append({k: row[k] for k in ("layout", "measured", "planned", "measured_phase")})
    print(RESULT + json.dumps(out))


if __name__ == "__main__":
    main(*[int(a) for a in sys.argv[1:7]])
