"""(a) Each TSP layer vs a single-process reference, D in {1, 2, 4}, fp64 and fp32."""

import pytest

from tests import checks_layers
from tests.common import TOL, DTYPES

DS = [1, 2, 4]


def _worst(results):
    return max(max(r.values()) for r in results)


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("d", DS)
@pytest.mark.parametrize(
    "gated,bias,activation,seq,batch,hidden,ffn,recompute",
    [
        (False, True, "gelu", 16, 2, 16, 32, True),  # GPT-2 style
        (True, False, "silu", 24, 3, 24, 40, True),  # SwiGLU, uneven sizes (ffn/D = 10)
        (True, True, "silu", 16, 2, 16, 32, False),  # fc1 outputs kept instead of recomputed
    ],
)
def test_mlp_matches_reference(pool4, seed, d, dtype, gated, bias, activation, seq, batch,
                               hidden, ffn, recompute):
    results = pool4.run(checks_layers.check_mlp, d, seed, dtype, gated, bias, seq, batch, hidden,
                        ffn, activation, recompute)
    assert _worst(results) <= TOL[DTYPES[dtype]], results[0]


@pytest.mark.parametrize("dtype", ["float64", "float32"])
@pytest.mark.parametrize("d", DS)
@pytest.mark.parametrize(
    "heads,groups,bias,rope,seq,batch,hidden,backward",
    [
        (4, 4, True, False, 16, 2, 32, "saved"),  # MHA with biases, no RoPE
        (8, 4, False, True, 24, 3, 64, "saved"),  # GQA 2:1, RoPE, no bias, S/2D uneven (3 at D=4)
        (8, 4, True, True, 16, 2, 64, "recompute"),  # attention forward recomputed in backward
    ],
)
def test_attention_matches_reference(pool4, seed, d, dtype, heads, groups, bias, rope, seq,
                                     batch, hidden, backward):
    results = pool4.run(checks_layers.check_attention, d, seed, dtype, heads, groups, bias, rope,
                        seq, batch, hidden, backward)
    assert _worst(results) <= TOL[DTYPES[dtype]], results[0]


@pytest.mark.parametrize("kind", ["mlp", "attention"])
def test_main_grad_contract(pool4, seed, kind):
    results = pool4.run(checks_layers.check_main_grad_contract, 2, seed, kind)
    assert _worst(results) <= 1e-6, results[0]  # main_grad is fp32
