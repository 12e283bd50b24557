"""The planner against the fake-tensor tool: one layout measured and planned side by side
(``compare``, run by the scripts ``planner_vs_fake.py`` and ``planner_moe_vs_fake.py`` in a fresh
interpreter each), and ``run``, which starts such a script and reads its result line."""

import os

from megatron_tsp.tools.estimator import fake_run as fr
from megatron_tsp.tools.estimator import planner as pl


def compare(shape, seq, scheme, kind, tp, cp, recompute, options, **run_kwargs) -> dict:
    """The fake tool's measured peak of one layout next to the planner's (``kind``, ``options``;
    the CPU backend the tool runs: ``attn_kernel="cpu_flash"``), with their breakdowns."""
    measured = fr.run_step(
        fr.RunConfig(
            scheme=scheme,
            model=shape,
            world_size=tp * cp,
            tp=tp,
            cp=cp,
            seq=seq,
            recompute=recompute,
            count_flops=False,
            count_comm=False,
            **run_kwargs,
        )
    )
    planned = pl.analytic_memory(
        shape,
        pl.Strategy(kind, tp=tp, cp=cp),
        seq,
        recompute=recompute,
        distributed_optimizer=False,
        options=options,
    )
    return {
        "layout": f"{measured.label} {recompute}",
        "measured": measured.peak_bytes,
        "planned": sum(planned.values()),
        "measured_phase": measured.peak_phase,
        "measured_by_category": measured.peak_breakdown,
        "planned_by_category": planned,
    }


def run(script: str, args, timeout: float) -> list:
    """``script`` (a file of this folder) in a fresh interpreter, one thread
    (``fake_run.run_in_fresh_process``); the list it prints after ``RESULT``."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), script)
    code = f"import runpy, sys; sys.argv = {[path, *map(str, args)]!r}; " + (
        f"runpy.run_path({path!r}, run_name='__main__')"
    )
    env = {"OMP_NUM_THREADS": "1", "TORCHDYNAMO_DISABLE": "1"}
    return fr.run_in_fresh_process(code, "", timeout, env)


RESULT = "@@RESULT@@"  # what run_in_fresh_process reads the result after
