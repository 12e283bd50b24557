"""Run in a subprocess by test_planner_moe.py: the fake-tensor tool (``fake_run.run_step``) and
the planner's ``analytic_memory`` on the same MoE layouts; prints one JSON line."""

import json
import sys
import warnings

warnings.filterwarnings("ignore")

from megatron_tsp.core.model_shape import ModelShape  # noqa: E402
from megatron_tsp.tools.estimator import fake_run as fr  # noqa: E402
from megatron_tsp.tools.estimator import planner as pl  # noqa: E402

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
        measured = fr.run_step(
            fr.RunConfig(
                scheme=scheme,
                model=shape,
                world_size=d,
                tp=d,
                seq=seq,
                recompute=recompute,
                moe_schedule=schedule,
                moe_dispatcher=dispatcher,
                count_flops=False,
                count_comm=False,
            )
        )
        planned = pl.analytic_memory(
            shape,
            pl.Strategy(kind, tp=d),
            seq,
            recompute=recompute,
            distributed_optimizer=False,
            options=pl.Options(
                attn_kernel="cpu_flash", moe_schedule=schedule, moe_dispatcher=dispatcher
            ),
        )
        out.append(
            {
                "layout": f"{measured.label} {recompute}",
                "measured": measured.peak_bytes,
                "planned": sum(planned.values()),
                "measured_phase": measured.peak_phase,
            }
        )
    print("@@RESULT@@" + json.dumps(out))


if __name__ == "__main__":
    main(*[int(a) for a in sys.argv[1:7]])
