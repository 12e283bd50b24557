"""The rejection table: conditions, messages, config fields, the generated docs.

The flags themselves are checked against Megatron-LM's argument parsers in
tests/megatron_lm/test_rejection_flags.py (needs the Megatron-LM trees)."""

import dataclasses
import os
import random
import re
import types

import pytest

from megatron_tsp.core import rejections as R
from megatron_tsp.core import validation

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_rows_are_unique_and_well_formed():
    for mode in R.MODE_FLAGS:
        flags = [r.flag for r in R.rows(mode)]
        assert len(flags) == len(set(flags)), mode
    for r in R.TABLE:
        assert r.flag.startswith("--") and r.dest.isidentifier() and r.reason
        assert set(r.modes) <= set(R.MODE_FLAGS) and set(r.versions) <= set(R.MEGATRON_LM_VERSIONS)
        assert r.layer in (None, "attention", "mlp") and r.stage in (R.PARSED, R.VALIDATED)
        # a row a layer checks must reach the layer through the config
        assert r.layer is None or r.config_field
        # valued flags need an example (the parser tests parse it); switches have none
        assert r.example or r.condition is R.SET
        # plain TP only shares the arithmetic (the rest of the table is about TSP)
        assert R.TP not in r.modes or r.condition.kind == "divide"


def test_config_fields_exist_in_transformer_config():
    from megatron.core.package_info import __version__
    from megatron.core.transformer import TransformerConfig

    installed = ".".join(__version__.split(".")[:2])
    fields = {f.name for f in dataclasses.fields(TransformerConfig)}
    # a row of another version only (``versions``) may name a field this megatron-core lacks
    missing = [
        r.config_field
        for r in R.TABLE
        if r.config_field and r.config_field not in fields and installed in r.versions
    ]
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
    row = R.row_for("cp_comm_type")
    assert row.message("a2a", 4) == (
        f"--cp-comm-type=a2a cannot be combined with --tensor-sequence-parallel-size=4: "
        f"{row.reason}"
    )
    hybrid = R.row_for("num_moe_experts", R.TSP_MLP)
    assert hybrid is R.row_for("num_experts", R.TSP_MLP)
    assert hybrid.message(8, None, R.TSP_MLP) == (
        f"--num-experts=8 cannot be combined with --tsp-mlp: {hybrid.reason}"
    )
    assert (
        R.row_for("qk_layernorm")
        .message(True, 2)
        .startswith("--qk-layernorm cannot be combined with --tensor-sequence-parallel-size=2: ")
    )
    assert (
        R.row_for("fp8")
        .message("hybrid", 8, config_value=True)
        .startswith(
            "--fp8-format=hybrid (TransformerConfig.fp8='hybrid') cannot be combined with "
            "--tensor-sequence-parallel-size=8"
        )
    )


D = 4
# What a TP / TSP group of D=4 can shard: the neighbouring valid values of the shape rows.
VALID_SHAPE = dict(
    num_attention_heads=8, num_query_groups=4, ffn_hidden_size=64, padded_vocab_size=1024
)
MODES = (R.TSP, R.TSP_MLP)


def _config(**fields):
    base = {r.config_field: None for r in R.TABLE if r.config_field}
    base.update(
        tensor_model_parallel_size=D,
        context_parallel_size=1,
        expert_model_parallel_size=1,
        softmax_type="vanilla",
        cuda_graph_impl="none",
        **{k: v for k, v in VALID_SHAPE.items() if k in base},
    )
    base.update(fields)
    return types.SimpleNamespace(**base)


def _refused_value(row):
    """The value of the row's ``example`` as argparse would store it (a switch: True)."""

    def number(text):
        try:
            return int(text)
        except ValueError:
            return text

    if not row.example:
        return True
    if len(row.example) > 1:
        return [number(x) for x in row.example]
    return number(row.example[0])


def _mode_named(message, mode):
    return (
        f"{R.SIZE_FLAGS[mode]}={D}" in message if mode == R.TSP or "divisible" in message else True
    ) and R.MODE_FLAGS[mode] in message


def _mode_rows(predicate):
    rows = [(mode, r) for mode in MODES for r in R.rows(mode) if predicate(r)]
    return pytest.mark.parametrize("mode,row", rows, ids=[f"{m}:{r.flag}" for m, r in rows])


@_mode_rows(lambda r: r.config_field)
def test_each_config_row_is_refused(mode, row):
    assert R.refusals_for_config(_config(), mode=mode) == []  # the neighbouring valid config
    value = _refused_value(row)
    problems = R.refusals_for_config(_config(**{row.config_field: value}), mode=mode)
    assert problems == [row.message(value, D, mode, config_value=True)]
    assert problems[0].startswith(row.shown(value))
    if row.condition.kind == "divide":
        assert f"{row.name}={value} is not divisible by {R.SIZE_FLAGS[mode]}={D}" in problems[0]
    else:
        assert f"TransformerConfig.{row.config_field}=" in problems[0]
    assert _mode_named(problems[0], mode)


def _args(mode, **fields):
    """Megatron-LM's parsed arguments as far as the table reads them: its defaults, plus the mode's
    own flags (``--tensor-sequence-parallel-size 4``, or TP=4 + SP + ``--tsp-mlp``)."""
    base = {r.dest: None for r in R.TABLE}
    base.update(
        tensor_model_parallel_size=1,
        context_parallel_size=1,
        expert_model_parallel_size=1,
        softmax_type="vanilla",
        cuda_graph_impl="none",
        attention_backend="auto",
        transformer_impl="transformer_engine",
        position_embedding_type="learned_absolute",
        tensor_sequence_parallel_size=None,
        tsp_mlp=False,
        sequence_parallel=False,
        spec=None,
        create_attention_mask_in_dataloader=True,
    )
    if mode == R.TSP:
        base.update(tensor_sequence_parallel_size=D)
    else:
        base.update(tsp_mlp=True, tensor_model_parallel_size=D, sequence_parallel=True)
    base.update(fields)
    return types.SimpleNamespace(**base)


@_mode_rows(lambda r: r.stage == R.PARSED)
def test_each_command_line_row_is_refused_by_the_launcher(mode, row):
    """Through ``translate_args`` (what the launcher runs): exactly this row's error, naming the
    flag, the value and the mode; Megatron-LM's defaults next to it pass."""
    from megatron_tsp.megatron_lm import arguments as A

    valid = _args(mode)
    A.translate_args(valid)
    assert valid.spec is not None
    value = _refused_value(row)
    refused = _args(mode, **{row.dest: value})
    with pytest.raises(A.TSPArgumentError) as err:
        A.translate_args(refused)
    assert str(err.value) == row.message(value, D if mode == R.TSP else None, mode)
    assert str(err.value).startswith(
        row.shown(value) + " cannot be combined with " + R.MODE_FLAGS[mode]
    )
    assert refused.spec is None


@_mode_rows(lambda r: r.stage == R.VALIDATED)
def test_each_shape_row_is_refused_after_validation(mode, row):
    """Shape rows need Megatron's derived values: ``check_model_shape`` (TSP) and the hybrid's
    ``check_validated_args`` give exactly the row's message; the valid shape passes."""
    from megatron_tsp.megatron_lm import arguments as A

    value = _refused_value(row)
    assert value % D != 0
    if mode == R.TSP:
        shape = dict(num_attention_heads=8, num_query_groups=4, ffn_hidden_size=64, vocab_size=1024)
        validation.check_model_shape(D, **shape)
        key = "vocab_size" if row.dest == "padded_vocab_size" else row.dest
        if key == "num_query_groups":
            shape["num_attention_heads"] = D * value  # heads % D == 0, heads % groups == 0
        with pytest.raises(ValueError) as err:
            validation.check_model_shape(D, **dict(shape, **{key: value}))
    else:
        args = _args(
            mode,
            num_attention_heads=8,
            num_query_groups=4,
            group_query_attention=True,
            ffn_hidden_size=64,
        )
        A.check_validated_args(args)
        if row.dest == "num_query_groups":
            args.num_attention_heads = D * value
        setattr(args, row.dest, value)
        with pytest.raises(A.TSPArgumentError) as err:
            A.check_validated_args(args)
    assert str(err.value) == row.message(value, D, mode)
    assert str(err.value).startswith(
        f"{row.name}={value} is not divisible by {R.SIZE_FLAGS[mode]}={D}"
    )


@pytest.mark.parametrize(
    "scheme,mode", [("tsp", R.TSP), ("hybrid", R.TSP_MLP), ("tp", R.TP), ("tp_sp", R.TP)]
)
def test_estimator_run_config_uses_the_shape_rows(scheme, mode):
    from megatron_tsp.core.model_shape import ModelShape
    from megatron_tsp.tools.estimator.fake_run import RunConfig

    model = ModelShape(hidden=64, num_layers=1, heads=8, query_groups=4, ffn=64, vocab=128)
    RunConfig(scheme=scheme, model=model, world_size=D, tp=D, seq=64).validate()
    bad = dataclasses.replace(model, ffn=66)
    with pytest.raises(ValueError) as err:
        RunConfig(scheme=scheme, model=bad, world_size=D, tp=D, seq=64).validate()
    assert str(err.value) == R.row_for("ffn_hidden_size", mode).message(66, D, mode)


def test_layer_filter_and_check_config_lists_all():
    cfg = _config(qk_layernorm=True, ffn_hidden_size=66, fp8="hybrid")
    assert [p.split()[0] for p in R.refusals_for_config(cfg, layer="attention")] == [
        "--qk-layernorm"
    ]
    assert [p.split()[0] for p in R.refusals_for_config(cfg, layer="mlp")] == [
        "--ffn-hidden-size=66"
    ]
    with pytest.raises(R.TSPRejection) as err:
        R.check_config(cfg)
    assert str(err.value).count("\n  - ") == 3


def test_transformer_config_check_uses_the_table():
    from megatron.core.transformer import TransformerConfig

    cfg = TransformerConfig(
        num_layers=1,
        hidden_size=32,
        num_attention_heads=4,
        tensor_model_parallel_size=2,
        sequence_parallel=True,
        qk_layernorm=True,
        softmax_type="off-by-one",
    )
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


@pytest.mark.parametrize("mode", MODES)
def test_docs_show_the_current_table(mode):
    text = open(os.path.join(REPO, "docs", "megatron-lm.md")).read()
    assert R.doc_block(mode) in text, (
        "docs/megatron-lm.md is out of date: replace the block between the rejections-table "
        f"markers with megatron_tsp.core.rejections.doc_block({mode!r})"
    )
    for r in R.rows(mode):
        assert f"`{r.name}`" in R.markdown_table(mode)


# What the table owns: a condition on these settings written anywhere else in the package is a
# second copy of a rule (the scan below fails on it). Arguments passed through by name are fine.
# The number of experts is not among the conditions: under TSP it selects the MoE layer spec
# (``specs.moe_layer_pattern``), it is refused only by the hybrid's table row.
_OWNED = r"(qk_layernorm|qk_l2_norm|num_moe_experts|num_experts|ffn\w*)"
_SECOND_COPIES = [
    # a condition on the setting (within one clause: ``a or b, qk_layernorm=...`` passes it on)
    re.compile(r"\b(if|elif|and|or|not|lambda)\b[^#\n,]*\b(qk_layernorm|qk_l2_norm)\b"),
    re.compile(r"getattr\([^)#\n]*['\"](qk_layernorm|num_moe_experts|num_experts)['\"]"),
    re.compile(r"\(\s*['\"]" + _OWNED + r"['\"]\s*,\s*(_\w+|lambda)"),  # (dest, test, why) rows
    re.compile(r"\b" + _OWNED + r"[\w.\]\)]*\s*%\s*\w"),  # ffn % d
    re.compile(r"\(\s*['\"](--)?ffn[\w-]*['\"]\s*,\s*[\w.]+\)"),  # (name, value) loops
    re.compile(r"--(qk-layernorm|num-experts|ffn-hidden-size)=\{"),  # a message of its own
    re.compile(r"['\"]--(qk-layernorm|num-experts)['\"]"),
]


def _second_copies(text):
    return [
        (n, line.strip())
        for n, line in enumerate(text.splitlines(), 1)
        if any(p.search(line) for p in _SECOND_COPIES)
    ]


def test_scan_finds_second_copies():
    """The scan below would catch the copies this table replaced."""
    copies = [
        'if getattr(config, "qk_layernorm", False):',
        '    ("num_experts", _truthy, "the TSP MLP ring replaces dense MLPs only"),',
        "    if ffn_hidden_size % size != 0:",
        '        for what, n in (("heads", m.heads), ("ffn", m.ffn_size)):',
        '                ("--ffn-hidden-size", args.ffn_hidden_size)):',
        '    raise ValueError(f"--ffn-hidden-size={ffn} is not divisible")',
        "    if qk_layernorm:",
        'flag = "--num-experts"',
    ]
    for line in copies:
        assert _second_copies(line), line
    fine = [
        '    rejections.check_values({"qk_layernorm": qk_layernorm}, d=None)',
        "                       qk_layernorm=config.qk_layernorm,",
        '    p.add_argument("--ffn-hidden-size", type=int)',
        "    return self.ffn or 4 * self.hidden",
        "    if config.num_moe_experts is None:",  # the MoE spec choice, not a refusal
    ]
    for line in fine:
        assert not _second_copies(line), line


def test_rules_live_only_in_the_table():
    package = os.path.join(REPO, "megatron_tsp")
    table = os.path.join(package, "core", "rejections.py")
    found = []
    for root, _, files in os.walk(package):
        for name in files:
            path = os.path.join(root, name)
            if name.endswith(".py") and path != table:
                with open(path) as f:
                    found += [(os.path.relpath(path, REPO), *c) for c in _second_copies(f.read())]
    assert not found, "rules written outside megatron_tsp/core/rejections.py:\n" + "\n".join(
        f"{p}:{n}: {line}" for p, n, line in found
    )


def test_one_declared_row_per_flag():
    """Each flag is written once (``ROWS``, ``SHAPE_ROWS`` or the hybrid-only ``TSP_MLP_ROWS``);
    another mode's own reason or condition lives in the row's ``also`` and becomes that mode's
    row in ``TABLE``."""
    declared = R.ROWS + R.SHAPE_ROWS + R.TSP_MLP_ROWS
    flags = [r.flag for r in declared]
    assert len(flags) == len(set(flags)), sorted(f for f in flags if flags.count(f) > 1)
    assert len(R.TABLE) == sum(len(r.per_mode()) for r in declared)
    row = next(r for r in R.ROWS if r.flag == "--attention-backend")
    tsp, hybrid = row.per_mode()
    assert tsp.modes == (R.TSP,) and hybrid.modes == (R.TSP_MLP,)
    assert hybrid.reason == row.also[R.TSP_MLP].reason != tsp.reason
    # the hybrid accepts local (it builds Megatron's local attention); TSP refuses it
    assert tsp.refuses("local") and not hybrid.refuses("local") and hybrid.refuses("flash")
    qk = next(r for r in R.ROWS if r.flag == "--qk-layernorm").per_mode()
    assert qk[0].layer == "attention" and qk[1].layer is None  # TSP's attention checks it


def test_packed_documents_accepted_thd_batches_refused_by_what_is_missing():
    """``--reset-attention-mask`` / ``--reset-position-ids`` run under TSP (the Megatron-LM batch
    hook reads the documents; tests/megatron_lm/test_packed_loop.py): no row refuses them. The THD
    flags stay refused, their messages naming what is not wired and the flags that work."""
    assert not {"--reset-attention-mask", "--reset-position-ids"} & set(R.flags())
    args = types.SimpleNamespace(reset_attention_mask=True, reset_position_ids=True)
    assert R.refusals_for_args(args, 2) == []
    for dest, flag in (
        ("sft", "--sft"),
        ("dataloader_inter_document_masking", "--dataloader-inter-document-masking"),
    ):
        message = R.row_for(dest).message(True, 2)
        assert message.startswith(f"{flag} cannot be combined with {R.TSP_FLAG}=2: "), message
        for named in (
            "THD",
            "packed_seq_params",
            "not wired through the Megatron-LM loop",
            "--reset-attention-mask --reset-position-ids",
        ):
            assert named in message, (named, message)
