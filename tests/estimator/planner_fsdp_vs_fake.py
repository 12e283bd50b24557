"""Run in a subprocess by test_memory_fsdp_cp.py: the fake-tensor tool's ``--scheme fsdp_cp``
(``fake_run.run_step``) and the planner's ``analytic_memory`` for ``fsdp_cp`` at one shape, with
and without full recompute; prints one JSON line."""

import json
import sys
import warnings

warnings.filterwarnings("ignore")

from megatron_tsp.core.model_shape import ModelShape, load_model  # noqa: E402
from megatron_tsp.tools.estimator import planner as pl  # noqa: E402
from tests.estimator.planner_check import RESULT, compare  # noqa: E402


def main(model, seq, n, recomputes, groups=None, tied=False):
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
    out = [compare(shape, seq, "fsdp_cp", "fsdp_cp", 1, n, r, options) for r in recomputes]
    print(RESULT + json.dumps(out))


if __name__ == "__main__":
    model, seq, n, recomputes = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    groups = int(sys.argv[5]) if len(sys.argv) > 5 and sys.argv[5] != "mha" else None
    tied = len(sys.argv) > 6 and sys.argv[6] == "tied"
    main(model, seq, n, recomputes.split(","), groups, tied)
