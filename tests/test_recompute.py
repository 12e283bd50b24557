"""(§4) Megatron's recompute options under TSP (~1 min).

``--recompute-activations`` / ``--recompute-granularity selective`` with ``core_attn`` selects
TSP's attention recompute mode, which is bitwise equal to the default saved mode;
``--recompute-granularity full`` and selective ``mlp`` (Megatron checkpoints the TSP MLP, ring
included) train the whole GPT exactly (fp64 parity with the stock single-process model); the TSP
MLP recomputes nothing unasked."""

import pytest

from tests import checks_recompute


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_attention_recompute_equals_saved_bitwise(pool4, seed, dtype):
    results = pool4.run(checks_recompute.recompute_equals_saved, 4, seed, dtype)
    for r in results:
        assert r["bitwise_equal"], (seed, r)
        assert r["selected"] == {
            "default": "saved",
            "selective_core_attn": "recompute",
            "selective_mlp_only": "saved",
        }
        assert r["kernel"] == "cpu_flash"


@pytest.mark.parametrize(
    "d,recompute", [(2, "full"), (4, "full"), (4, "selective"), (2, "selective_mlp")]
)
def test_gpt_with_megatron_recompute_fp64(pool4, seed, d, recompute):
    results = pool4.run(checks_recompute.gpt_recompute_vs_single, d, seed, "llama", recompute)
    for r in results:
        assert max(r["errors"].values()) <= 1e-10, (seed, r)
        assert r["modes"] == (["recompute"] if recompute.startswith("selective") else ["saved"])
        # the MLP is recomputed only when Megatron's flags ask, by Megatron's own checkpoint;
        # the TSP MLP never adds its fc1 recompute on its own
        assert r["mlp"] == [(recompute == "selective_mlp", False)], r
