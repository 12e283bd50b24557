"""Run in a subprocess by test_memory_fsdp_cp.py: the fake-tensor tool's ``--scheme fsdp_cp``
(``fake_run.run_step``) and the planner's ``analytic_memory`` for ``fsdp_cp`` at one shape, with
and without full recompute; prints one JSON line.

``--cp-comm-type=p2p`` anywhere in the arguments: TE's P2P ring on both sides (the tool's
``KVRingAttention``, the planner's ``fsdp_cp_ring``, ``kv_flavour="ring"``)."""

import json
import sys
import warnings

warnings.filterwarnings("ignore")

from megatron_tsp.core.model_shape import ModelShape, load_model  # noqa: E402
from megatron_tsp.tools.estimator import fake_run as fr  # noqa: E402
from megatron_tsp.tools.estimator import planner as pl  # noqa: E402
from tests.estimator.planner_check import RESULT  # noqa: E402

RING_FLAG = "--cp-comm-type=p2p"


def compare(shape, seq, n, recompute, options, ring) -> dict:
    """``planner_check.compare`` for FSDP x CP with the K/V exchange chosen on both sides."""
    measured = fr.run_step(
        fr.RunConfig(
            scheme="fsdp_cp",
            model=shape,
            world_size=n,
            tp=1,
            cp=n,
            seq=seq,
            recompute=recompute,
            count_flops=False,
            count_comm=False,
            cp_comm_type="p2p" if ring else "all_gather",
        )
    )
    strategy = pl.Strategy("fsdp_cp", tp=1, cp=n, kv_flavour="ring" if ring else "all_gather")
    planned = pl.analytic_memory(
        shape, strategy, seq, recompute=recompute, distributed_optimizer=False, options=options
    )
    return {
        "layout": f"{measured.label} {recompute}",
        "measured": measured.peak_bytes,
        "planned": sum(planned.values()),
        "measured_phase": measured.peak_phase,
        "measured_by_category": measured.peak_breakdown,
        "planned_by_category": planned,
    }


def main(model, seq, n, recomputes, groups=None, tied=False, ring=False):
    if model == "7b":
        shape = load_model("7b")
    else:  # h=512, 2 layers, 8 heads, vocab 4096 (LayerNorm, not gated: planner_vs_fake's)
        shape = ModelShape(
            name="check",
            hidden=512,
            num_layers=2,
            heads=8,
            query_groups=groups,
            vocab=4096,
            tied_embeddings=tied,
        )
    options = pl.Options(attn_kernel="cpu_flash")
    out = [compare(shape, seq, n, r, options, ring) for r in recomputes]
    print(RESULT + json.dumps(out))


if __name__ == "__main__":
    ring = RING_FLAG in sys.argv
    argv = [a for a in sys.argv if a != RING_FLAG]
    model, seq, n, recomputes = argv[1], int(argv[2]), int(argv[3]), argv[4]
    groups = int(argv[5]) if len(argv) > 5 and argv[5] != "mha" else None
    tied = len(argv) > 6 and argv[6] == "tied"
    main(model, seq, n, recomputes.split(","), groups, tied, ring)
