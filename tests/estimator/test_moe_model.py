"""MoE model files and the analytic MoE model (``megatron_tsp.tools.estimator.moe``).

The ring and allgather formulas are also checked against counted collectives of the real layers
(tests/test_moe.py uses the same functions); here: the model files' parameter counts against the
published totals, the crossover's definition, the refusals of the dense-only tools, the CLI."""

import dataclasses

import pytest

from megatron_tsp.core.model_shape import ModelShape, load_model
from megatron_tsp.megatron_lm.configs import megatron_model_fields
from megatron_tsp.tools.estimator import moe


@pytest.mark.parametrize(
    "name,published,rel",
    # Mixtral-8x7B: 46.7B parameters; DeepSeek-V2-Lite: 15.7B (its MLA attention is modelled as
    # MHA here, see the file's assumptions, hence the wider tolerance)
    [("mixtral-8x7b", 46.7e9, 0.002), ("deepseek-v2-lite", 15.7e9, 0.02)],
)
def test_moe_model_files_count_the_published_parameters(name, published, rel):
    m = load_model(name)
    assert m.is_moe and m.moe_layers == m.num_layers - m.moe_dense_layers
    assert m.num_params() == pytest.approx(published, rel=rel)
    dense_equivalent = dataclasses.replace(
        m, num_experts=None, moe_ffn=None, moe_shared_ffn=None, moe_dense_layers=0
    )
    expert_extra = m.moe_layers * (m.moe_layer_params - m.layer_params)
    assert m.num_params() == dense_equivalent.num_params() + expert_extra


def test_moe_fields_are_validated_and_absent_from_dense_files():
    assert "num_experts" not in load_model("7b").to_json()
    assert "moe_topk" not in load_model("7b").to_json()
    with pytest.raises(ValueError, match="need num_experts"):
        ModelShape(hidden=64, num_layers=2, heads=4, moe_ffn=32)
    with pytest.raises(ValueError, match="top-k"):
        ModelShape(hidden=64, num_layers=2, heads=4, num_experts=4, moe_topk=5)
    with pytest.raises(ValueError, match="moe_dense_layers"):
        ModelShape(hidden=64, num_layers=2, heads=4, num_experts=4, moe_dense_layers=2)
    m = load_model("deepseek-v2-lite")
    assert ModelShape.from_json(m.to_json()) == m


def test_megatron_arguments_of_an_moe_model():
    m = load_model("deepseek-v2-lite")
    fields = megatron_model_fields(m, 4096)
    assert fields["num_experts"] == 64 and fields["moe_router_topk"] == 6
    assert fields["moe_ffn_hidden_size"] == 1408
    assert fields["moe_shared_expert_intermediate_size"] == 2816
    # Megatron's --moe-layer-freq pattern expression, one 0 (dense) / 1 (MoE) per layer
    assert eval(fields["moe_layer_freq"]) == m.moe_layer_freq == [0] + [1] * 26
    assert "moe_layer_freq" not in megatron_model_fields(load_model("mixtral-8x7b"), 4096)
    assert "num_experts" not in megatron_model_fields(load_model("7b"), 4096)


@pytest.mark.parametrize("name", ["mixtral-8x7b", "deepseek-v2-lite"])
@pytest.mark.parametrize("d", [2, 4, 8])
def test_crossover_is_where_the_ring_and_the_alltoall_receive_equal_bytes(name, d):
    m = load_model(name)
    s = moe.ring_crossover_seq(m, d)
    metadata = (d - 1) * m.num_experts * moe.INT64  # the token-count all-gather, not in S*
    ring = moe.ring_received(m, d) - 2 * (d - 1) / d * moe.INT64 * m.num_experts
    assert moe.alltoall_expected_received(m, d, s / d) - metadata == pytest.approx(ring, rel=1e-12)
    # ring bytes: (D-1)/D of the experts' weights, forward w, backward w + fp32 accumulator
    w = m.dtype_bytes
    assert ring == pytest.approx((d - 1) / d * m.w_experts * (2 * w + 4), rel=1e-12)
    below, above = moe.report_rows(m, d, [d * 1024 * (int(s) // (d * 1024)), 2 * d * int(s)])
    assert below["ring"] > below["alltoall"] and above["ring"] < above["alltoall"]


def test_ring_collectives_are_independent_of_tokens_and_allgather_grows_with_them():
    m = load_model("mixtral-8x7b")
    rows = moe.report_rows(m, 8, [32768, 131072])
    assert rows[0]["ring"] == rows[1]["ring"]
    assert rows[1]["allgather"] == pytest.approx(4 * rows[0]["allgather"], rel=1e-3)
    buffers = moe.ring_buffers(m, 8)
    shard = m.w_experts / 8
    assert buffers == {"forward": 3 * shard * 2, "backward": 3 * shard * 2 + 3 * shard * 4}


def test_moe_cli(capsys):
    assert moe.main(["--model", "deepseek-v2-lite", "--seq-lengths", "32768,131072"]) == 0
    out = capsys.readouterr().out
    assert "Crossover" in out and "| 131072 | 16384 |" in out
    assert moe.main(["--model", "7b"]) == 2
    assert "dense" in capsys.readouterr().err


@pytest.mark.parametrize("d", [2, 4, 8])
def test_ring_buffers_equal_the_measured_peak(d):
    """``moe.ring_buffers`` against MemTracker's peak of the real ring function
    (``tsp_expert_ring``) on shape-only bf16 tensors in a fake world of D ranks, with no tokens:
    what remains is exactly the ring's buffers (the parameters exist before the measurement),
    forward alone and forward + backward."""
    import torch.nn.functional as F

    from megatron_tsp.core.layers.mlp import MLPActivation
    from megatron_tsp.megatron_lm.fake_world import destroy_fake_world, init_fake_world

    experts, h, ffn = 4, 256, 512
    m = ModelShape(hidden=h, num_layers=1, heads=4, gated=True, num_experts=experts, moe_ffn=ffn)
    init_fake_world(d)

    def swiglu(pre):
        gate, up = pre.chunk(2, dim=-1)
        return F.silu(gate) * up

    swiglu = MLPActivation(swiglu)

    peaks = {}
    try:
        _measure_ring(d, experts, h, ffn, swiglu, peaks)
    finally:
        destroy_fake_world()
    assert peaks == moe.ring_buffers(m, d)


def _measure_ring(d, experts, h, ffn, activation, peaks):
    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode

    from megatron_tsp.core.layers.moe_ring import tsp_expert_ring
    from megatron_tsp.tools.estimator.fake_run import lean_mem_tracker

    for phase in ("forward", "backward"):
        with FakeTensorMode(allow_non_fake_inputs=True):
            params = []
            for _ in range(experts):
                params.append(torch.empty(2 * ffn // d, h, dtype=torch.bfloat16))
                params.append(torch.empty(h, ffn // d, dtype=torch.bfloat16))
            for p in params:
                p.requires_grad_(True)
            x = torch.empty(0, h, dtype=torch.bfloat16, requires_grad=True)
            tracker = lean_mem_tracker()
            with tracker:
                out = tsp_expert_ring(x, [0] * experts, params, False, dist.group.WORLD, activation)
                if phase == "backward":
                    out.backward(torch.empty(0, h, dtype=torch.bfloat16))
            peaks[phase] = max(tracker._peak_mem.values())
