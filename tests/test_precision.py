"""bf16 precision: TSP is no less accurate than Megatron TP+SP.

Both run in bf16 on the same bf16-representable weights and batch at D=4; errors are measured
against an fp64 single-process model. TSP sums D partials (outputs, grad_x, weight gradients)
where TP+SP reduce-scatters D bf16-rounded partials; with fp32 accumulators (layers/precision.py)
TSP rounds once. Both sides' numbers are printed (pytest -s) whatever the outcome.
Runtime: about 2 min on 4 gloo ranks (2 shared CPU cores): ~20 s for the MLP tests, ~25 s per
whole-model test (three seeds, an fp64 reference and two bf16 models each).
"""

import math
import secrets
import statistics

import pytest

from tests import checks_precision

D = 4


# The fc1 bias gradient is a sum over every token of d(fc1 output), whose bf16 errors add with
# random signs, so one seed's TSP / TP+SP error ratio is noisy: over 48 seeds (D = 4, GeLU with
# bias) mean 0.982, range 0.917-1.093, above 1.01 in 8 of 48 (the inputs differ by one rounding:
# TSP's fc1 GEMM adds the bias before rounding, Megatron's fused bias-GeLU adds it in fp32 after).
# It is judged by its mean over MLP_SEEDS seeds (sd of the mean ~0.014), 3 sd above the measured
# mean; per seed the weight matrices read 0.97-1.00 and keep the 1.01 bound.
MLP_SEEDS = 8
MLP_BIAS_GRAD_TOLERANCE = 1.03


def test_split_error_is_independent_of_the_split(pool4, seed):
    """The activation criteria compare TSP's error with TP+SP's strictly ("TSP <= TP+SP"), and the
    embedding's output is the same bf16 tensor in both: its error must read the same bit for bit
    whether the rows are split zigzag (TSP) or contiguously (TP+SP). A per-rank sum then
    all-reduce differed in the last fp64 digit and failed CI on equal tensors."""
    readings = pool4.run(checks_precision.split_error_reads_the_same, D, seed)[0]
    for i, (zigzag_read, contiguous_read, whole) in enumerate(readings):
        assert zigzag_read == contiguous_read, (seed, i, zigzag_read, contiguous_read)
        assert zigzag_read == pytest.approx(whole, rel=1e-12), (seed, i, zigzag_read, whole)


@pytest.mark.parametrize("gated,bias", [(True, False), (False, True)])
def test_mlp_bf16_no_less_accurate_than_tp_sp(pool4, seed, gated, bias):
    """One MLP layer: TSP's output and input gradient are summed in fp32 (TP+SP sums D bf16
    partials in its reduce-scatters), so they must be at least as accurate, seed by seed; each
    weight gradient is one fp32 sum rounded once on both sides (equal up to summation order):
    each weight matrix within 1% of TP+SP's error per seed, the biases on the mean over
    ``MLP_SEEDS`` seeds."""
    runs = [
        pool4.run(checks_precision.mlp_bf16_errors_vs_fp64, D, seed + i, gated, bias)[0]
        for i in range(MLP_SEEDS)
    ]
    print(f"\nMLP bf16 D={D} gated={gated} bias={bias}, seeds from {seed}: error vs fp64")
    print("  (mean over the seeds, TP+SP | TSP)")
    for name in runs[0]["tsp"]:
        a, b = (statistics.mean(r[k][name] for r in runs) for k in ("tp_sp", "tsp"))
        print(f"  {name:28s} {a:.3e} | {b:.3e}")
    for i, r in enumerate(runs):
        for name in ("output", "grad:input"):
            assert r["tsp"][name] <= r["tp_sp"][name], (seed + i, name, r)
        for name in r["tsp"]:
            if name.startswith("grad:linear") and name.endswith(".weight"):
                assert r["tsp"][name] <= 1.01 * r["tp_sp"][name], (seed + i, name, r)
    for name in runs[0]["tsp"]:
        if name.startswith("grad:linear") and name.endswith(".bias"):
            ratio = statistics.mean(r["tsp"][name] / r["tp_sp"][name] for r in runs)
            assert ratio <= MLP_BIAS_GRAD_TOLERANCE, (name, ratio, seed)


# Tolerances of the whole-model test (TSP error / TP+SP error, each a mean over GPT_SEEDS seeds),
# measured over 6-16 seeds per style: TSP's hidden-state error was below TP+SP's in 32/32 single
# seeds (ratio <= 0.993), and in 48/48 more with the bf16 dK/dV wire (docs/precision.md), so it is
# asserted without tolerance. The per-token loss is dominated by rounding both sides do
# identically (bf16 logits): over sliding 3-seed windows its ratio spanned 0.90-1.12. The
# gradients are judged by the geometric mean over all parameters of the per-parameter error ratio
# (``_grad_geomean``): 24 seeds per style with the default bf16 wire, mean 0.986 / 0.987 (Llama /
# GPT-2), per-seed sd 0.024 / 0.031, 3-seed means <= 1.011. The median over parameters is printed
# only: in a two-layer model it is one matrix's error, and five matrices lie within 5% of it, so
# which one it is changes from seed to seed (per-seed sd 0.05; a CI run drew a 3-seed mean of
# 1.076 on the same code whose 24-seed mean is 1.008). The mean per-matrix ratio over the MLP's
# weight matrices spanned 0.98-1.01 (1.05-1.07 then, 1.042 on main now, with a bf16 accumulator
# planted in TSP's MLP), over attention's 0.94-1.06 (1.10-1.19 planted in attention; the QKV
# weight gradient is the noisiest, 0.88-1.29 per seed; with the bf16 dK/dV wire the per-seed
# mean is 1.019 / 1.026, sd 0.046 / 0.031, and one 5-seed mean read 1.056, hence 1.08);
# test_gpt_bf16_check_catches_planted_bf16_accumulation shows they catch it.
# Those draws had fp32 activation sums. With the default in-place bf16 sums (MLP output, grad_x;
# docs/precision.md), on 12 more seeds per style (the same seeds for both settings): geometric
# mean 1.006 / 0.995 (Llama / GPT-2; fp32 sums 0.998 / 0.990), per-seed sd 0.030 / 0.044, the
# paired difference +0.007 / +0.006; hidden states 0.984 / 0.979 (fp32 sums 0.981 / 0.956). The
# gradient bound is unchanged, over GPT_SEEDS seeds (below): pooling both draws and adding the
# paired difference, the expected geometric mean is ~0.997 / 0.994 with per-seed sd ~0.026 /
# 0.035, so an 8-seed mean sat 3.6 / 2.9 sd below 1.03 (with 5 seeds: 2.8 / 2.3).
TOKEN_LOSS_TOLERANCE = 1.15
GRAD_GEOMEAN_TOLERANCE = 1.03
WEIGHT_GRAD_TOLERANCE = {".mlp.linear_": 1.03, ".self_attention.linear_": 1.08}
# TSP2 x CP2 against TP2+SP (docs/precision.md): 16 seeds per style with the gradients'
# geometric-mean criterion: bf16 ring reduce-scatter of dK/dV (default) 1.004 / 0.898 (Llama /
# GPT-2; 5-seed means <= 1.016), --tsp-kv-grad-all-to-all 0.997 / 0.900; held to the C = 1 bound.
# The attention weight gradients' per-seed mean ratio 1.050 / 1.018 (5-seed means <= 1.074) with
# the ring, 1.040 / 1.010 (<= 1.057) with the all-to-all, which is held to the C = 1 bounds. The
# median gradient error (printed only) read 1.045 / 0.974 per seed, 5-seed means up to 1.086.
# Hidden states: TSP's error above TP+SP's in 5 of 16 single Llama seeds (<= 1.01), 5-seed means
# <= 0.995. Measured again on main, 40 seeds per style: the final norm's per-seed ratio 0.987 /
# 0.979 (sd 0.010; layers 0.984-0.986 / 0.978-0.979), so a 5-seed mean sat only ~2.8 sd under the
# strict bound (largest of eight 5-seed blocks 0.996); 8 seeds put it ~3.5 sd under (and every
# gradient criterion further under its bound).
CP_SEEDS = 8
CP_RING_TOLERANCE = 1.10


@pytest.mark.parametrize("style", ["llama", "gpt2"])
def test_gpt_bf16_no_less_accurate_than_tp_sp(pool4, style):
    """Two-layer GPTModel (llama: GQA + RoPE + SwiGLU + RMSNorm; gpt2: MHA + learned positions +
    GeLU + LayerNorm + biases), Megatron's vocab-parallel cross-entropy, ``GPT_SEEDS`` batches /
    weight sets (``_gpt_runs``, shared with the dK/dV-wire test), errors against fp64 averaged
    over them; TSP with its default (bf16) dK/dV wire.

    Forward: each layer's output and the final norm's output (the tensors TSP computes
    differently) must be no less accurate than TP+SP's, without tolerance. The scalar loss error
    is printed but not asserted: it is a signed sum of ~1e-4 per-token errors that cancel to
    ~1e-5, far below bf16 resolution, and over 16 seeds it fell on either side of TP+SP's (7/16
    and 8/16 seeds below). The loss is judged as a tensor instead: the per-token loss error
    (Frobenius, relative) within ``TOKEN_LOSS_TOLERANCE`` of TP+SP's. Gradients: the geometric
    mean over all parameters of TSP's error / TP+SP's within ``GRAD_GEOMEAN_TOLERANCE`` (the
    median gradient error is printed). Weight gradients: the mean over
    the linear layers' weight matrices of TSP's error / TP+SP's within ``WEIGHT_GRAD_TOLERANCE``
    (each is one fp32 GEMM rounded once in TP+SP; TSP sums D per-rank partials in fp32)."""
    first, raw = _gpt_runs(pool4, style)
    _report_and_check_gpt([{k: r[k] for k in ("tp_sp", "tsp")} for r in raw], first, style)


_OUTPUT_WEIGHT = "output_layer.weight"


@pytest.mark.parametrize("style", ["llama", "gpt2"])
def test_gpt_bf16_vocab_ring_no_less_accurate_than_tp_sp(pool4, style):
    """The loss on the vocabulary ring (``core.output_head``, the launcher's default under TSP)
    against Megatron TP+SP's output layer and vocab-parallel cross-entropy, on the same seeds as
    ``test_gpt_bf16_no_less_accurate_than_tp_sp`` and with its criteria; the output weight's
    gradient (D partial fp32 GEMMs summed in fp32 on the ring, one fp32 GEMM in TP+SP) is held to
    the linear weights' bound, and the final norm's output (the head's input) is among the hidden
    states checked without tolerance."""
    first, raw = _gpt_runs(pool4, style)
    runs = [{"tp_sp": r["tp_sp"], "tsp": r["tsp_vocab_ring"]} for r in raw]
    _report_and_check_gpt(runs, first, f"{style}, vocab ring")
    ratio = statistics.mean(
        r["tsp"]["per_param"][_OUTPUT_WEIGHT] / r["tp_sp"]["per_param"][_OUTPUT_WEIGHT]
        for r in runs
    )
    print(f"  output weight gradient: mean TSP/TP+SP error {ratio:.3f}")
    assert ratio <= WEIGHT_GRAD_TOLERANCE[".mlp.linear_"], f"output weight gradient {ratio:.3f}"


@pytest.mark.parametrize("style", ["llama", "gpt2"])
def test_gpt_bf16_tsp_x_cp_no_less_accurate_than_tp_sp(pool4, seed, style):
    """TSP2 x CP2 (4 ranks, K/V gathered and dK/dV reduce-scattered over the 4 sequence ranks)
    against Megatron TP=2+SP, both in bf16 against the fp64 single-process model, with the
    criteria of ``test_gpt_bf16_no_less_accurate_than_tp_sp``. Megatron's own CP attention needs
    Transformer Engine (absent here), so the baseline is TP+SP with C = 1: CP changes only which
    rank holds which tokens, and the fp64 model is the common reference.

    Gradients are summed over CP in fp32 and not rounded back, as Megatron's DDP does for bf16.
    The attention weight gradients get ``CP_RING_TOLERANCE``: the bf16 dK/dV
    reduce-scatter now sums D*C = 4 bf16 partials instead of D, rounding at each hop
    (docs/precision.md, TSP x CP). With ``--tsp-kv-grad-all-to-all`` (the partials summed in
    fp32 at the owner) the C = 1 criteria hold unchanged."""
    kinds = ("tp_sp", "tsp_cp2", "tsp_cp2_a2a")
    raw = [
        pool4.run(checks_precision.bf16_errors_vs_fp64, 2, seed + i, style, kinds=kinds)[0]
        for i in range(CP_SEEDS)
    ]
    ring = {".self_attention.linear_": CP_RING_TOLERANCE}
    for kind, weights in (("tsp_cp2", ring), ("tsp_cp2_a2a", None)):
        runs = [{"tp_sp": r["tp_sp"], "tsp": r[kind]} for r in raw]
        what = f"{style}, TSP2 x CP2 ({kind}) vs TP2+SP"
        _report_and_check_gpt(runs, seed, what, weights)


# The planted-regression test below: TSP's weight-gradient error with its fp32 partial sums
# replaced by bf16 ones, on the shared draw's seeds and against its TP+SP runs, judged by the
# whole-model criteria over all GPT_SEEDS seeds. Measured on main (Llama), the mean per-matrix
# ratio: MLP weights 1.042 planted (72 seeds, per-seed sd 0.011; four 16-seed means 1.038-1.043)
# vs 0.996 not (24 seeds; planted and unplanted seeds differ by 0.04-0.05 seed for seed),
# attention weights 1.119 planted (24 seeds, sd 0.042) vs ~1.02. Judged on 3 seeds of its own the
# MLP plant sat ~2 sd above its 1.03 bound and one CI run read 1.029 (seeds from 853419750); over
# 16 it sits ~4 sd above (attention 3.6 sd above 1.08).


@pytest.mark.parametrize("plant", ["mlp", "attention"])
def test_gpt_bf16_check_catches_planted_bf16_accumulation(pool4, plant):
    """The whole-model criteria can fail: with TSP's MLP or attention partial sums accumulated in
    bf16 (the regression fp32 accumulation fixed), the llama-style check must fail on the same
    seeds, weights and TP+SP runs that ``test_gpt_bf16_no_less_accurate_than_tp_sp`` passes."""
    first, shared = _gpt_runs(pool4, "llama")
    runs = [
        {
            "tp_sp": shared[i]["tp_sp"],
            "tsp": pool4.run(
                checks_precision.bf16_errors_vs_fp64,
                D,
                first + i,
                "llama",
                plant_bf16_accumulation=plant,
                kinds=("tsp",),
            )[0]["tsp"],
        }
        for i in range(GPT_SEEDS)
    ]
    family = {"mlp": "mlp.linear_", "attention": "self_attention.linear_"}[plant]
    with pytest.raises(AssertionError, match=f"{family} weight gradients"):
        _report_and_check_gpt(runs, first, f"llama, bf16 accumulation planted in TSP's {plant}")


def _mean_of(runs, kind, *keys):
    values = []
    for r in runs:
        v = r[kind]
        for k in keys:
            v = v[k]
        values.append(v)
    return statistics.mean(values)


def _grad_geomean(run) -> float:
    """Geometric mean over all parameters of TSP's gradient error / TP+SP's, for one seed."""
    base = run["tp_sp"]["per_param"]
    return math.exp(statistics.mean(math.log(run["tsp"]["per_param"][n] / base[n]) for n in base))


def _report_and_check_gpt(
    runs,
    seed,
    style,
    weight_tolerance=None,
    grad_geomean_tolerance=GRAD_GEOMEAN_TOLERANCE,
):
    print(
        f"\n{style} bf16 D={D}, error vs fp64, mean of {len(runs)} seeds from {seed} (TP+SP | TSP)"
    )
    failures = []
    for name in runs[0]["tsp"]["activations"]:
        a, b = (_mean_of(runs, k, "activations", name) for k in ("tp_sp", "tsp"))
        print(f"  hidden:{name:19s} {a:.3e} | {b:.3e}")
        if b > a:
            failures.append(f"hidden state {name}: TSP {b:.3e} > TP+SP {a:.3e}")
    for metric, tolerance in (
        ("loss", None),
        ("token_losses", TOKEN_LOSS_TOLERANCE),
        ("grad_median", None),
    ):
        a, b = (_mean_of(runs, k, metric) for k in ("tp_sp", "tsp"))
        note = "(printed only)" if tolerance is None else f"(TSP <= {tolerance} x TP+SP)"
        print(f"  {metric:26s} {a:.3e} | {b:.3e}  {note}")
        if tolerance is not None and b > tolerance * a:
            failures.append(f"{metric}: TSP {b:.3e} > {tolerance} x TP+SP {a:.3e}")
    geomean = statistics.mean(_grad_geomean(r) for r in runs)
    print(
        f"  gradients: geometric mean over parameters of TSP/TP+SP error {geomean:.3f} "
        f"(<= {grad_geomean_tolerance})"
    )
    if geomean > grad_geomean_tolerance:
        failures.append(
            f"gradients: geometric-mean TSP/TP+SP error ratio {geomean:.3f} > "
            f"{grad_geomean_tolerance}"
        )
    tolerances = {**WEIGHT_GRAD_TOLERANCE, **(weight_tolerance or {})}
    weight_ratios = {family: [] for family in tolerances}
    for name in runs[0]["tsp"]["per_param"]:
        a, b = (_mean_of(runs, k, "per_param", name) for k in ("tp_sp", "tsp"))
        print(f"    {name:58s} {a:.3e} | {b:.3e}")
        for family, ratios in weight_ratios.items():
            if family in name and name.endswith(".weight"):
                ratios.append(b / a)
    for family, ratios in weight_ratios.items():
        ratio, tolerance = statistics.mean(ratios), tolerances[family]
        print(
            f"  {family.strip('.')} weight gradients: mean TSP/TP+SP error ratio {ratio:.3f} "
            f"(<= {tolerance})"
        )
        if ratio > tolerance:
            failures.append(
                f"{family.strip('.')} weight gradients: mean TSP/TP+SP error ratio "
                f"{ratio:.3f} > {tolerance}"
            )
    assert not failures, f"seed={seed} style={style}: " + "; ".join(failures)


# The whole-model runs of the two tests above and below: per style, GPT_SEEDS consecutive seeds
# from one fresh seed, each an fp64 reference and three bf16 models (TP+SP, TSP with the default
# bf16 dK/dV wire, TSP with the fp32 wire), drawn once per test session (~3 s per seed on the
# CI machine). 16 seeds: the dK/dV-wire test judges the geometric mean by its median over the
# seeds, which moves 1.25x as much as a mean. Measured on main, 48 seeds per style: per-seed mean
# 0.993 / 0.992 (Llama / GPT-2), sd 0.022 / 0.035, so an 8-seed GPT-2 median sat ~2.4 sd below
# 1.03 and a draw of 8 (from 1699284072, the same on the previous commit) read 1.035; with 16 it
# sits ~3.5 sd below (the mean of the test above ~4.3 sd).
GPT_SEEDS = 16
_GPT_KINDS = ("tp_sp", "tsp", "tsp_kv_fp32", "tsp_vocab_ring")
_gpt_cache = {}


def _gpt_runs(pool4, style):
    """``(first seed, [bf16_errors_vs_fp64 result per seed])`` for ``style``, computed once."""
    if style not in _gpt_cache:
        first = secrets.randbelow(2**31)
        print(f"whole-model bf16 runs, {style}: seeds {first}..{first + GPT_SEEDS - 1}")
        runs = [
            pool4.run(checks_precision.bf16_errors_vs_fp64, D, first + i, style, kinds=_GPT_KINDS)[
                0
            ]
            for i in range(GPT_SEEDS)
        ]
        _gpt_cache[style] = (first, runs)
    return _gpt_cache[style]


# dK/dV wire: tolerances on the median over the GPT_SEEDS seeds of TSP's error /
# TP+SP's (robust to the one noisy seed a mean is not). Measured (docs/precision.md, D = 4, 24
# seeds per style, the same seeds for each setting): the geometric mean over parameters of the
# gradient-error ratio 0.986 / 0.987 (Llama / GPT-2) with the bf16 wire and 0.977 / 0.984 with
# the fp32 wire (5-seed medians <= 1.011); the first layer's QKV weight gradient, the one the
# dK/dV feeds, 1.061 / 1.065 (per seed 0.92-1.29) with the bf16 wire, whose collective adds the D
# partials in bf16, and 1.003 / 1.033 (0.86-1.20) with the fp32 wire, whose only extra rounding
# is each rank's partial dK/dV leaving the attention kernel in bf16. An earlier 10-seed Llama
# draw read 1.10 / 1.05, one CI run a 5-seed median of 1.178 on the bf16 wire.
KV_WIRE_TOLERANCE = 1.03  # gradients' geometric-mean ratio, default wire
# One matrix's ratio varies from seed to seed (per-seed sd up to 0.094), so a 5-seed median moves
# by about 0.05: each wire's bound is about 2.5 such steps above its measured mean (pooled over
# every draw: bf16 1.08, fp32 1.03). The bf16 wire's bound is above 1: the default trades
# 5-10% on this one matrix for 0.75x TP+SP's wire bytes.
KV_WIRE_QKV_TOLERANCE = {"qkv": 1.21, "qkv_fp32": 1.15}
_QKV = "decoder.layers.0.self_attention.linear_qkv.weight"


@pytest.mark.parametrize("style", ["llama", "gpt2"])
def test_gpt_bf16_dkv_wire_within_tp_sp(pool4, style):
    """TSP's dK/dV reduce-scatter in bf16 (the default: TP+SP's activation gradients travel in
    bf16 too) against TP+SP and against the fp32 wire (``kv_grad_reduce_in_fp32``), each vs an
    fp64 model, over ``GPT_SEEDS`` seeds: per seed the gradients' geometric-mean error ratio and
    the first layer's QKV weight-gradient error (the gradient the dK/dV feeds), printed for both
    settings (docs/precision.md). Asserted, on the median over seeds of TSP's / TP+SP's error:
    the default's geometric-mean ratio <= ``KV_WIRE_TOLERANCE``; the QKV weight gradient within
    ``KV_WIRE_QKV_TOLERANCE`` for each wire."""
    first, runs = _gpt_runs(pool4, style)
    print(
        f"\n{style} bf16 D={D}, error vs fp64 per seed from {first}: TP+SP | TSP bf16 wire | "
        "TSP fp32 wire (geo: geometric mean over parameters of TSP/TP+SP)"
    )
    ratios = {"geo": [], "qkv": [], "geo_fp32": [], "qkv_fp32": []}
    for i, r in enumerate(runs):
        qkv = [r[k]["per_param"][_QKV] for k in _GPT_KINDS]
        geo = [_grad_geomean({"tp_sp": r["tp_sp"], "tsp": r[k]}) for k in _GPT_KINDS[1:]]
        print(
            f"  seed {first + i}: geo {geo[0]:.3f} | {geo[1]:.3f}   "
            f"qkv {qkv[0]:.4e} | {qkv[1]:.4e} | {qkv[2]:.4e}"
        )
        ratios["geo"].append(geo[0])
        ratios["qkv"].append(qkv[1] / qkv[0])
        ratios["geo_fp32"].append(geo[1])
        ratios["qkv_fp32"].append(qkv[2] / qkv[0])
    medians = {k: statistics.median(v) for k, v in ratios.items()}
    print(
        "  median over seeds of TSP / TP+SP: "
        + ", ".join(f"{k} {v:.3f}" for k, v in medians.items())
    )
    limits = {"geo": KV_WIRE_TOLERANCE, **KV_WIRE_QKV_TOLERANCE}
    for key, limit in limits.items():
        assert medians[key] <= limit, (first, key, limit, medians, ratios)
