"""MoE models in the fake-tensor run (``megatron-tsp memory``): megatron-core's MoE layers on
shape-only tensors under uniform routing (``tools/estimator/uniform_routing.py``).

* the fake-tensor peak equals the CPU allocator's peak of the same step on real tensors (fresh
  process), for both TSP schedules, both dispatchers and the TP+SP baseline with the same EP;
* uniform routing against the router's own choice (real tensors, the expert ring: no token
  exchange, so a one-rank run routes for real): the peaks agree;
* the bytes the run counts from the issued collectives equal ``estimator.moe``'s formulas for
  the MoE layers (the schedules differ only there, so their differences are compared);
* the CLI: an MoE model runs and prints its layout.
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest

warnings.filterwarnings("ignore", message=".*Transformer Engine.*")
warnings.filterwarnings("ignore", message=".*Apex.*")

from megatron_tsp.core.model_shape import ModelShape, load_model  # noqa: E402
from megatron_tsp.tools.comm_counter import received_fraction  # noqa: E402
from megatron_tsp.tools.estimator import fake_run, moe  # noqa: E402
from megatron_tsp.tools.estimator.fake_run import RunConfig, run_step  # noqa: E402
from megatron_tsp.tools.estimator.memory import main as memory_main  # noqa: E402
from megatron_tsp.tools.estimator.uniform_routing import expert_counts  # noqa: E402
from tests.estimator.fake_world_fixture import _fake_world_teardown  # noqa: E402,F401

# "small" (h=256, 4 layers, vocab 2048) with 4 SwiGLU experts of FFN 512, top-2: peaks ~80-95 MB
SMALL_MOE = dataclasses.replace(
    load_model("small"),
    name="small-moe",
    num_experts=4,
    moe_topk=2,
    moe_ffn=512,
    gated=True,
    normalization="RMSNorm",
)
# a dense layer, then an MoE layer with a shared expert (h=128, vocab 512): the bytes test
TINY_MOE = ModelShape(
    name="tiny-moe",
    hidden=128,
    num_layers=2,
    heads=8,
    vocab=512,
    gated=True,
    normalization="RMSNorm",
    num_experts=4,
    moe_topk=2,
    moe_ffn=256,
    moe_shared_ffn=128,
    moe_dense_layers=1,
)


def _cfg(model, scheme="tsp", schedule="folded", dispatcher="alltoall", **kw):
    base = dict(model=model, world_size=4, tp=4, seq=2048, count_flops=False, count_comm=False)
    base.update(kw)
    return RunConfig(scheme=scheme, moe_schedule=schedule, moe_dispatcher=dispatcher, **base)


def test_expert_counts_spread_every_copy():
    assert expert_counts(10, 4) == [3, 3, 2, 2]
    assert expert_counts(8, 4) == [2, 2, 2, 2]
    assert sum(expert_counts(4097 * 6, 64)) == 4097 * 6


@pytest.mark.parametrize(
    "scheme,schedule,dispatcher",
    [
        ("tsp", "folded", "alltoall"),
        ("tsp", "folded", "allgather"),
        ("tsp", "ring", "allgather"),
        ("tp_sp", "folded", "alltoall"),
    ],
)
def test_moe_fake_peak_matches_real_run(scheme, schedule, dispatcher):
    """Measured: 0.04-0.07% apart (fake below real by the CPU flash kernel's scratch)."""
    kw = dict(scheme=scheme, schedule=schedule, dispatcher=dispatcher)
    fake = run_step(_cfg(SMALL_MOE, fake=True, **kw))
    real = fake_run.run_step_isolated(_cfg(SMALL_MOE, fake=False, **kw))
    err = abs(fake.peak_bytes - real.real_peak_bytes) / real.real_peak_bytes
    assert err < 0.02, (kw, fake.peak_bytes, real.real_peak_bytes)
    assert fake.static_bytes == real.static_bytes


def test_uniform_routing_against_the_routers_choice():
    """The expert ring on real tensors, routed by the model's router (uneven per-expert counts)
    vs the fake run's uniform routing: the permuted buffers hold T*k rows either way, so the
    peaks agree (measured 0.3% apart)."""
    fake = run_step(_cfg(SMALL_MOE, schedule="ring", fake=True))
    routed = fake_run.run_step_isolated(
        _cfg(SMALL_MOE, schedule="ring", fake=False, moe_routing="router")
    )
    assert abs(fake.peak_bytes - routed.real_peak_bytes) / routed.real_peak_bytes < 0.02
    with pytest.raises(ValueError, match="router"):
        _cfg(SMALL_MOE, fake=True, moe_routing="router").validate()


def test_moe_counted_bytes_equal_the_formulas():
    """TSP D=4 on TINY_MOE (one MoE layer): the schedules issue the same collectives outside the
    MoE layer, so the differences of their counted forward + backward bytes are the formulas'
    differences for one MoE layer (uniform routing makes the alltoall's expectation exact)."""
    d, seq = 4, 1024
    tokens = seq // d
    runs = {}
    layouts = (("ring", "allgather"), ("folded", "alltoall"), ("folded", "allgather"))
    for schedule, dispatcher in layouts:
        r = run_step(
            _cfg(TINY_MOE, schedule=schedule, dispatcher=dispatcher, seq=seq, count_comm=True)
        )
        runs[(schedule, dispatcher)] = r.comm["recv_bytes_forward"] + r.comm["recv_bytes_backward"]
    m = TINY_MOE
    router = received_fraction("all_reduce", d) * 8 * m.num_experts  # in the ring's formula
    ring = moe.ring_received(m, d)
    alltoall = moe.alltoall_expected_received(m, d, tokens) + router
    allgather = moe.allgather_received(m, d, d, tokens)
    base = runs[("ring", "allgather")]
    assert runs[("folded", "alltoall")] - base == pytest.approx(alltoall - ring, abs=1e-6)
    assert runs[("folded", "allgather")] - base == pytest.approx(allgather - ring, abs=1e-6)
    assert expert_counts(tokens * m.moe_topk, m.num_experts) == [128] * 4  # exact expectation


def test_moe_cli(capsys):
    args = ["--model", "deepseek-v2-lite", "--num-layers", "2", "--tp", "4", "--world-size", "4"]
    args += ["--seq", "4096", "--no-flops"]
    assert memory_main(args + ["--moe-schedule", "ring"]) == 0
    out = capsys.readouterr().out
    assert "TSP D=4 ring" in out
    crossover = moe.ring_crossover_seq(load_model("deepseek-v2-lite"), 4)
    assert f"from S = {crossover:,.0f} tokens" in out
    assert memory_main(args + ["--expert-model-parallel-size", "2"]) == 0
    assert "TSP D=4 EP2 alltoall" in capsys.readouterr().out
    with pytest.raises(ValueError, match="ring is the TSP expert ring"):
        _cfg(SMALL_MOE, scheme="tp_sp", schedule="ring").validate()
    with pytest.raises(ValueError, match="--scheme tsp"):
        _cfg(SMALL_MOE, scheme="tp_cp", cp=2, tp=2).validate()
    with pytest.raises(ValueError, match="--expert-model-parallel-size 3: num_experts=4"):
        _cfg(SMALL_MOE, ep=3, world_size=12).validate()
