"""bf16 precision: TSP is no less accurate than Megatron TP+SP (issue 12 section 3).

Both run in bf16 on the same bf16-representable weights and batch at D=4; errors are measured
against an fp64 single-process model. TSP sums D partials (outputs, grad_x, weight gradients)
where TP+SP reduce-scatters D bf16-rounded partials; with fp32 accumulators (layers/precision.py)
TSP rounds once. Both sides' numbers are printed (pytest -s) whatever the outcome.
Runtime: about 20 s on 4 gloo ranks.
"""

import statistics

import pytest

from tests import checks_precision

D = 4


@pytest.mark.parametrize("gated,bias", [(True, False), (False, True)])
def test_mlp_bf16_no_less_accurate_than_tp_sp(pool4, seed, gated, bias):
    """One MLP layer: TSP's output and input gradient are summed in fp32 (TP+SP sums D bf16
    partials in its reduce-scatters), so they must be at least as accurate; each weight
    gradient is one fp32 sum rounded once on both sides (equal up to summation order)."""
    r = pool4.run(checks_precision.mlp_bf16_errors_vs_fp64, D, seed, gated, bias)[0]
    print(f"\nMLP bf16 D={D} gated={gated} bias={bias}: error vs fp64 (TP+SP | TSP)")
    for name in r["tsp"]:
        print(f"  {name:28s} {r['tp_sp'][name]:.3e} | {r['tsp'][name]:.3e}")
    for name in ("output", "grad:input"):
        assert r["tsp"][name] <= r["tp_sp"][name], (name, r)
    for name in r["tsp"]:
        if name.startswith("grad:linear"):
            assert r["tsp"][name] <= 1.01 * r["tp_sp"][name], (name, r)


@pytest.mark.xfail(strict=False, reason="attention now accumulates in fp32 (attn12) and TSP's "
                   "median gradient error is at or below TP+SP's, but its bf16 loss error is "
                   "still 1.2-1.4x TP+SP's (cause not isolated yet)")
@pytest.mark.parametrize("style", ["llama", "gpt2"])
def test_gpt_bf16_no_less_accurate_than_tp_sp(pool4, seed, style):
    """Two-layer GPTModel (llama: GQA + RoPE + SwiGLU + RMSNorm; gpt2: MHA + learned positions +
    GeLU + LayerNorm + biases), Megatron's vocab-parallel cross-entropy. Three batches/weight sets
    (seeds ``seed .. seed+2``): the mean over them of the loss error and of the median (over
    parameters) gradient error must not exceed TP+SP's."""
    runs = [pool4.run(checks_precision.bf16_errors_vs_fp64, D, seed + i, style)[0]
            for i in range(3)]
    summary = {kind: {"loss": statistics.mean(r[kind]["loss"] for r in runs),
                      "grad_median": statistics.mean(r[kind]["grad_median"] for r in runs)}
               for kind in ("tp_sp", "tsp")}
    print(f"\n{style} bf16 D={D}, error vs fp64, mean of 3 seeds from {seed} (TP+SP | TSP)")
    for metric in ("loss", "grad_median"):
        print(f"  {metric:12s} {summary['tp_sp'][metric]:.3e} | {summary['tsp'][metric]:.3e}")
    for name in runs[0]["tsp"]["per_param"]:
        a = statistics.mean(r["tp_sp"]["per_param"][name] for r in runs)
        b = statistics.mean(r["tsp"]["per_param"][name] for r in runs)
        print(f"    {name:58s} {a:.3e} | {b:.3e}")
    for metric in ("loss", "grad_median"):
        assert summary["tsp"][metric] <= summary["tp_sp"][metric], (metric, summary)
