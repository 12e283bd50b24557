"""``megatron-tsp compare`` (tools/estimator/compare_table.py): the table's cells are the planner's
numbers for the configuration it picks, the pick is the planner's fastest fitting one, the step
terms sum to the planner's step time, and the verdict names the terms by which TSP's step is
longer. The generated blocks in docs/benchmark.md and README.md are checked by
tests/test_docs_numbers.py (ids ``compare`` and ``readme-compare``)."""

from dataclasses import replace

import pytest

from megatron_tsp.tools.estimator import compare_table as ct
from megatron_tsp.tools.estimator import formulas as fm
from megatron_tsp.tools.estimator.formulas import LayerShape
from megatron_tsp.tools.estimator.planner_inputs import GB, load_hardware, load_model
from megatron_tsp.tools.estimator.strategies import MOE_KINDS, Options, default_strategies
from megatron_tsp.tools.estimator.timing import (
    cheapest_fitting_layer_time,
    evaluate,
    layer_terms,
    num_microbatches,
)

SEQ, GPUS = 131072, 64


@pytest.fixture(scope="module")
def hw():
    return load_hardware("h100")


@pytest.fixture(scope="module")
def row(hw):
    (r,) = ct.build(["7b"], [SEQ], [GPUS], hw, Options())
    return r


def _planner_candidates(kinds, gpus):
    """What ``megatron-tsp plan --strategies KINDS --cp C,...`` plans, through the planner's own
    constructors and its divisibility filter (``planner.main``)."""
    cps = [c for c in (2, 4, 8, 16, 32, 64) if gpus % (8 * c) == 0]
    out = []
    for k in kinds:
        if k == "tp_cp":
            out += default_strategies(8, [k]) + default_strategies(8, [k], cps)
        elif k == "tsp_cp":
            out += default_strategies(8, [k], cps)
        elif k in ("tsp", "tp_sp"):
            out += default_strategies(8, [k])
        else:
            out += default_strategies(8, [k], [1] + cps)
    return [s for s in out if gpus % s.degree == 0 and (gpus // s.degree) % s.remat == 0]


def test_cells_are_the_planners_numbers(row, hw):
    m = load_model("7b")
    for family, kinds in ct.FAMILIES:
        cell = row["cells"][family]
        assert cell.row is not None, family  # at 128k on 64 H100s every layout has a fit
        # the pick: the fastest (tokens/s) of every planned configuration at every recompute
        # setting cheapest_fitting_layer_time tries that fits
        best = max(
            (
                c["tokens_per_s"]
                for s in _planner_candidates(kinds, GPUS)
                for c in cheapest_fitting_layer_time(m, hw, s, SEQ, GPUS, 8, Options())[
                    "candidates"
                ]
                if c["fits"]
            )
        )
        assert cell.row["tokens_per_s"] == pytest.approx(best, rel=1e-12), family
        # every printed number is the planner's row for the picked configuration
        attn = cell.setting == "attn"
        recompute = "none" if attn else cell.setting
        o = replace(Options(), recompute=recompute, tsp_recompute_attn=attn)
        r = evaluate(m, hw, cell.strategy, SEQ, GPUS, o)
        cols = ct.cell_columns(cell)
        assert cols[0] == r["strategy"] and cols[1] == cell.setting
        assert cols[2] == f"{r['memory_total_bytes'][recompute] / GB:.1f}"
        assert float(cols[2]) <= hw.hbm_gb
        assert cols[6].split()[0] == f"{r['step_s']:.2f}"
        assert cols[7] == f"{100 * r['mfu']:.1f}"
        # wire: every layer's received bytes (the planner's terms) x micro-batches + DP's
        comm = fm.sum_terms(layer_terms(LayerShape.of(m, 1, SEQ), cell.strategy, o))
        nmb = num_microbatches(o, GPUS // cell.strategy.degree, SEQ)
        wire = m.num_layers * nmb * (fm.fwd(comm) + fm.bwd(comm))
        wire += sum(r["dp_comm_bytes"].values())
        assert cols[3] == f"{wire / GB:.1f}"
        # HBM bytes and launches: the planner's recorded kernels, or marked as FLOP-priced
        if r["compute_model"] == "measured":
            k = r["layer_kernels"]
            again = 2 if recompute == "full" else 1
            launches = k["fwd"]["kernels"] * again + k["bwd"]["kernels"]
            hbm = k["fwd"]["bytes"] * again + k["bwd"]["bytes"]
            assert cols[5] == str(launches) and cols[4] == f"{hbm / GB:.1f}"
            assert not cols[6].endswith("ᶠ")
        else:
            assert cols[4] == cols[5] == "—" and cols[6].endswith("ᶠ")


def test_step_terms_sum_to_the_planners_step(row, hw):
    m = load_model("7b")
    for family, cell in row["cells"].items():
        t, r = cell.terms, cell.row
        assert sum(t.values()) == pytest.approx(r["step_s"], rel=1e-12), family
        assert abs(t["rest"]) <= 1e-9 * r["step_s"], family  # a dense model: no other term
        n = r["num_microbatches"] * m.num_layers
        assert t["exposed"] == pytest.approx(n * sum(r["layer_exposed_s"].values()), rel=1e-12)
        assert t["head"] == pytest.approx(r["num_microbatches"] * r["head_s"], rel=1e-12)
        # compute without recompute (the none setting's) splits into FLOPs / HBM / launches
        o = replace(Options(), recompute="none", tsp_recompute_attn=False)
        base = evaluate(m, hw, cell.strategy, SEQ, GPUS, o)
        compute = n * sum(base["layer_compute_s"].values())
        assert t["flops"] + t["hbm"] + t["launches"] == pytest.approx(compute, rel=1e-12)
        assert (t["recompute"] > 0) == (cell.setting != "none"), family
        if r["compute_model"] == "flops":
            assert t["hbm"] == t["launches"] == 0.0


def _cell(family, step_terms, name):
    """A stand-in cell whose step time is the sum of ``step_terms``."""
    terms = {k: step_terms.get(k, 0.0) for k in ct.TERMS}
    step = sum(terms.values())
    r = {"strategy": name, "tokens_per_s": 1e6 / step, "compute_model": "flops"}
    return ct.Cell(family, row=r, setting="none", terms=terms)


def test_verdict_names_the_terms_tsp_loses_on():
    base = {"flops": 10.0, "exposed": 1.0, "recompute": 0.0, "sync": 0.5}
    cells = {
        "TSP": _cell("TSP", {**base, "exposed": 4.0, "recompute": 0.2}, "TSP8"),
        "TSP x CP": ct.Cell("TSP x CP", note="none on 8 GPUs"),
        "FSDP x CP": _cell("FSDP x CP", base, "FSDPxCP8"),
    }
    v = ct.verdict(cells, None, None, SEQ, 8)
    assert v["fastest"] is cells["FSDP x CP"] and v["tsp"] is cells["TSP"]
    # +3 s exposed, +0.2 s recompute: 0.2 is 6% of 3.2 (< REASON_SHARE), not named
    assert v["reasons"] == ["exposed"]
    assert "exposed communication +3 s" in v["text"] and "recompute" not in v["text"]
    # the recompute term grows past the exposed one: named first
    cells["TSP"] = _cell("TSP", {**base, "exposed": 2.0, "recompute": 5.0}, "TSP8")
    v = ct.verdict(cells, None, None, SEQ, 8)
    assert v["reasons"] == ["recompute", "exposed"]
    assert v["text"].index("recompute (memory) +5 s") < v["text"].index("exposed communication")
    # TSP faster: no reason
    cells["TSP"] = _cell("TSP", {**base, "flops": 9.0}, "TSP8")
    v = ct.verdict(cells, None, None, SEQ, 8)
    assert v["tsp"] is v["fastest"] and v["reasons"] == [] and v["text"] == "TSP8 fastest"


def test_verdict_of_a_planned_row_follows_its_terms(row):
    v = row["verdict"]
    tsp, fastest = v["tsp"], v["fastest"]
    assert tsp is not None and fastest is not None
    if tsp is fastest:
        assert v["reasons"] == []
        return
    diff = {k: tsp.terms[k] - fastest.terms[k] for k in ct.TERMS}
    assert v["reasons"][0] == max(diff, key=diff.get)
    assert sum(diff.values()) == pytest.approx(tsp.row["step_s"] - fastest.row["step_s"], rel=1e-9)
    for k in v["reasons"]:
        assert f"{ct.TERMS[k]} +{diff[k]:.3g} s" in v["text"]


def test_moe_cells_not_modelled_name_the_reason(hw):
    (r,) = ct.build(["mixtral-8x7b"], [SEQ], [GPUS], hw, Options())
    m = load_model("mixtral-8x7b")
    for family, kinds in ct.FAMILIES:
        cell = r["cells"][family]
        if set(kinds) <= set(MOE_KINDS):
            assert cell.row is not None or cell.note.startswith("nothing fits"), family
            continue
        assert cell.row is None and cell.note.startswith("not modelled"), family
        assert " / ".join(MOE_KINDS) in cell.note
        # the planner refuses the layout for an MoE model: the note is its reason
        s = _planner_candidates(kinds, GPUS)[0]
        with pytest.raises(ValueError, match="MoE layers"):
            evaluate(m, hw, s, SEQ, GPUS, Options())


@pytest.mark.parametrize(
    "argv, flag",
    [
        (["--gpus", "12"], "--gpus"),
        (["--gpus", "8", "--seq-lengths", "1000"], "--seq-lengths"),
        (["--models", "nosuchmodel"], "--models nosuchmodel"),
    ],
)
def test_bad_input_names_the_flag(argv, flag, capsys):
    from megatron_tsp.tools import cli

    with pytest.raises(SystemExit) as exc:
        cli.main(["compare", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and flag in err and argv[-1] in err
