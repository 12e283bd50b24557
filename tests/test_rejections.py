"""The rejection table: conditions, messages, config fields, the generated docs.

The flags themselves are checked against Megatron-LM's argument parsers in
tests/megatron_lm/test_rejection_flags.py (needs the Megatron-LM trees)."""

import dataclasses
import os
import random
import types

import pytest

from megatron_tsp.core import rejections as R
from megatron_tsp.core import validation

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_rows_are_unique_and_well_formed():
    flags = [r.flag for r in R.TABLE]
    assert len(flags) == len(set(flags))
    for r in R.TABLE:
        assert r.flag.startswith("--") and r.dest.isidentifier() and r.reason
        assert set(r.modes) <= set(R.MODE_FLAGS) and set(r.versions) <= set(R.MEGATRON_LM_VERSIONS)
        assert r.layer in (None, "attention", "mlp")
        # a row a layer checks must reach the layer through the config
        assert r.layer is None or r.config_field
        # valued flags need an example (the parser tests parse it); switches have none
        assert r.example or r.condition is R.SET


def test_config_fields_exist_in_transformer_config():
    from megatron.core.transformer import TransformerConfig

    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    missing = [r.config_field for r in R.TABLE if r.config_field and r.config_field not in fields]
    assert not missing, f"not TransformerConfig fields in this megatron-core: {missing}"


def test_conditions():
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    d = rng.choice([2, 4, 8])
    assert R.ONE_OR_D.refuses(d + 1, d) and not R.ONE_OR_D.refuses(d, d), seed
    assert not R.ONE_OR_D.refuses(1, d) and not R.ONE_OR_D.refuses(None, d)
    limit = rng.randint(1, 5)
    assert R.above(limit).refuses(limit + 1) and not R.above(limit).refuses(limit), seed
    assert not R.above(limit).refuses(None)
    for value in (True, 3, "x", [2, 2], (128, 0)):
        assert R.SET.refuses(value)
    for value in (None, False, 0, "", [], ()):
        assert not R.SET.refuses(value)
    enum_like = types.SimpleNamespace(name="flash")
    assert R.other_than("auto").refuses(enum_like)
    assert not R.other_than("auto").refuses(types.SimpleNamespace(name="auto"))
    assert R.one_of("mrope").refuses("mrope") and not R.one_of("mrope").refuses("rope")


def test_messages_name_flag_value_and_size():
    row = R.row_for("num_experts")
    assert row is R.row_for("num_moe_experts")
    assert row.message(8, 4) == (
        f"--num-experts=8 cannot be combined with --tensor-sequence-parallel-size=4: {row.reason}")
    assert R.row_for("qk_layernorm").message(True, 2).startswith(
        "--qk-layernorm cannot be combined with --tensor-sequence-parallel-size=2: ")
    assert R.row_for("fp8").message("hybrid", 8, config_value=True).startswith(
        "--fp8-format=hybrid (TransformerConfig.fp8='hybrid') cannot be combined with "
        "--tensor-sequence-parallel-size=8")


def _config(**fields):
    base = {r.config_field: None for r in R.TABLE if r.config_field}
    base.update(tensor_model_parallel_size=4, context_parallel_size=1,
                expert_model_parallel_size=1, softmax_type="vanilla", cuda_graph_impl="none")
    base.update(fields)
    return types.SimpleNamespace(**base)


@pytest.mark.parametrize("row", [r for r in R.TABLE if r.config_field],
                         ids=[r.flag for r in R.TABLE if r.config_field])
def test_each_config_row_is_refused(row):
    assert R.refusals_for_config(_config()) == []
    value = {"context_parallel_size": 2, "expert_model_parallel_size": 2,
             "softmax_type": "learnable", "cuda_graph_impl": "local",
             "hierarchical_context_parallel_sizes": [2, 2]}.get(row.config_field, True)
    problems = R.refusals_for_config(_config(**{row.config_field: value}))
    assert len(problems) == 1 and problems[0].startswith(row.flag)
    assert f"TransformerConfig.{row.config_field}=" in problems[0]
    assert "--tensor-sequence-parallel-size=4" in problems[0]


def test_layer_filter_and_check_config_lists_all():
    cfg = _config(qk_layernorm=True, num_moe_experts=8, fp8="hybrid")
    assert [p.split()[0] for p in R.refusals_for_config(cfg, layer="attention")] == [
        "--qk-layernorm"]
    assert [p.split()[0] for p in R.refusals_for_config(cfg, layer="mlp")] == ["--num-experts=8"]
    with pytest.raises(R.TSPRejection) as err:
        R.check_config(cfg)
    assert str(err.value).count("\n  - ") == 3


def test_transformer_config_check_uses_the_table():
    from megatron.core.transformer import TransformerConfig

    cfg = TransformerConfig(num_layers=1, hidden_size=32, num_attention_heads=4,
                            tensor_model_parallel_size=2, sequence_parallel=True,
                            qk_layernorm=True, softmax_type="off-by-one")
    with pytest.raises(ValueError) as err:
        validation.check_transformer_config(cfg)
    text = str(err.value)
    assert "--qk-layernorm (TransformerConfig.qk_layernorm=True)" in text
    assert "--softmax-type=off-by-one" in text and "--tensor-sequence-parallel-size=2" in text


def test_spec_getter_uses_the_table():
    from megatron_tsp.core.specs import get_gpt_layer_tsp_spec

    with pytest.raises(ValueError, match=r"^--multi-latent-attention \(TransformerConfig"):
        get_gpt_layer_tsp_spec(multi_latent_attention=True)


def test_parallel_layout_uses_the_table():
    with pytest.raises(ValueError) as err:
        validation.check_parallel_layout(16, 4, tensor_model_parallel_size=2)
    assert str(err.value) == R.row_for("tensor_model_parallel_size").message(2, 4)


def test_docs_show_the_current_table():
    text = open(os.path.join(REPO, "docs", "megatron-lm.md")).read()
    assert R.doc_block() in text, (
        "docs/megatron-lm.md is out of date: replace the block between the rejections-table "
        "markers with megatron_tsp.core.rejections.doc_block()")
    for r in R.rows():
        assert f"`{r.flag}`" in R.markdown_table()
