"""Analytic estimators: communication / FLOP formulas (``formulas``), the planner (``planner``).

``memory`` (fake-tensor measurement) and ``flops_count`` are separate modules; nothing heavy is
imported here."""

from .formulas import (  # noqa: F401
    LayerShape,
    cp_layer_comm,
    crossover_seq_length,
    layer_flops,
    tp_cp_layer_comm,
    tp_layer_comm,
    tp_sp_layer_comm,
    tsp_layer_comm,
    tsp_layer_split,
)
