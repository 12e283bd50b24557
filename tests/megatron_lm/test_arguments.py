"""The TSP argument group, its translation into Megatron's arguments, and the rejections."""

import argparse

import pytest

from megatron_tsp.core import rejections
from megatron_tsp.megatron_lm import arguments as A
from tests.megatron_lm.common import megatron_parser


def parse(*argv):
    return megatron_parser().parse_args(list(argv))


def test_group_is_in_help_and_parses():
    parser = megatron_parser()
    help_text = parser.format_help()
    assert "tensor-sequence parallel:" in help_text
    for flag in (
        "--tensor-sequence-parallel-size D",
        "--tsp-dry-run",
        "--tsp-dry-run-world-size",
        "--tsp-dry-run-rank",
        "--tsp-kv-grad-reduce-in-fp32",
        "--tsp-kv-grad-all-to-all",
        "--tsp-activation-sums-in-fp32",
    ):
        assert flag in help_text
    args = parser.parse_args(["--tensor-sequence-parallel-size", "4", "--tsp-dry-run"])
    assert args.tensor_sequence_parallel_size == 4 and args.tsp_dry_run
    assert parser.parse_args([]).tensor_sequence_parallel_size is None
    # idempotent: a second call adds nothing (argparse would raise on a duplicate flag)
    assert A.add_tsp_arguments(parser) is parser
    assert sum(a.dest == "tensor_sequence_parallel_size" for a in parser._actions) == 1


@pytest.mark.parametrize("d", [1, 2, 8])
def test_translation_sets_tp_sp_and_spec(d):
    args = parse("--tensor-sequence-parallel-size", str(d), "--num-attention-heads", "8")
    A.translate_args(args)
    assert args.tensor_model_parallel_size == d
    assert args.sequence_parallel is (d > 1)
    assert args.spec == [A.SPEC_MODULE, A.SPEC_ATTR]
    assert not hasattr(args, "tsp_replaced_spec")


def test_translation_turns_the_dataloader_mask_off():
    # Megatron builds an S x S mask per sample by default; TSP attention never reads it.
    args = parse("--tensor-sequence-parallel-size", "2")
    assert args.create_attention_mask_in_dataloader is True
    A.translate_args(args)
    assert args.create_attention_mask_in_dataloader is False and args.tsp_disabled_dataloader_mask
    args = parse("--tensor-sequence-parallel-size", "2", "--no-create-attention-mask-in-dataloader")
    A.translate_args(args)
    assert not args.create_attention_mask_in_dataloader
    assert not getattr(args, "tsp_disabled_dataloader_mask", False)  # nothing to announce


def test_translation_is_noop_without_flag():
    args = parse("--tensor-model-parallel-size", "4", "--sequence-parallel")
    before = dict(vars(args))
    A.translate_args(args)
    assert vars(args) == before


def test_user_spec_is_replaced_and_recorded():
    args = parse("--tensor-sequence-parallel-size", "2", "--spec", "local")
    A.translate_args(args)
    assert args.spec == [A.SPEC_MODULE, A.SPEC_ATTR]
    assert args.tsp_replaced_spec == ["local"]


def test_tp_equal_to_d_is_accepted_and_sequence_parallel_redundant():
    args = parse(
        "--tensor-sequence-parallel-size",
        "4",
        "--tensor-model-parallel-size",
        "4",
        "--sequence-parallel",
    )
    A.translate_args(args)
    assert args.tensor_model_parallel_size == 4 and args.sequence_parallel


# rows on the command line as typed (shape rows need Megatron's derived values: see
# tests/test_rejections.py)
ROWS = rejections.rows(rejections.TSP, stage=rejections.PARSED)


@pytest.mark.parametrize("row", ROWS, ids=[r.flag for r in ROWS])
def test_every_table_row_is_refused_by_name(row):
    args = parse("--tensor-sequence-parallel-size", "2", *row.argv())
    with pytest.raises(A.TSPArgumentError) as err:
        A.translate_args(args)
    message = str(err.value)
    shown = row.flag if not row.example else f"{row.flag}={' '.join(row.example)}"
    assert message.startswith(shown + " cannot be combined with --tensor-sequence-parallel-size=2")
    assert row.reason in message
    assert isinstance(err.value, ValueError)
    # nothing was translated: the user's arguments are untouched on error
    assert args.spec is None


def test_defaults_are_accepted():
    args = parse("--tensor-sequence-parallel-size", "2")
    assert A.unsupported_combinations(args) == []


@pytest.mark.parametrize(
    "argv",
    [
        ["--tensor-model-parallel-size", "4"],  # = D
        ["--attention-backend", "auto"],
        ["--cuda-graph-impl", "none"],
        ["--softmax-type", "vanilla"],
        ["--position-embedding-type", "rope"],
        ["--transformer-impl", "local"],
        ["--context-parallel-size", "1"],
        ["--context-parallel-size", "2"],  # TSP x CP
        ["--context-parallel-size", "2", "--cp-comm-type", "allgather"],
        ["--expert-model-parallel-size", "1"],
        ["--tensor-parallel-num-weight-shards", "1"],
        # packed documents: the batch hook reads them (megatron_lm/documents.py)
        ["--reset-attention-mask", "--reset-position-ids"],
        ["--reset-attention-mask", "--reset-position-ids", "--context-parallel-size", "2"],
        ["--reset-position-ids", "--pipeline-model-parallel-size", "2"],
    ],
)
def test_allowed_values_pass(argv):
    args = parse("--tensor-sequence-parallel-size", "4", *argv)
    assert A.unsupported_combinations(args) == []


def test_several_problems_are_listed_together():
    args = parse(
        "--tensor-sequence-parallel-size",
        "2",
        "--cp-comm-type",
        "a2a",
        "--tp-comm-overlap",
        "--moe-expert-capacity-factor",
        "1.0",
    )
    with pytest.raises(A.TSPArgumentError) as err:
        A.translate_args(args)
    text = str(err.value)
    assert text.count("\n  - ") == 3
    for flag in (
        "--cp-comm-type=a2a",
        "--tp-comm-overlap",
        "--moe-expert-capacity-factor=1.0",
    ):
        assert flag in text


def test_packed_documents_keep_the_mask_off_and_refuse_later_pipeline_stages():
    """Under TSP the dataloader's S x S mask stays off with the document flags (the batch hook
    reads the documents from the position ids or the EOD tokens); Megatron's own attention
    (no TSP flag) keeps it. Later pipeline stages get no tokens or position ids: refused."""
    args = parse("--tensor-sequence-parallel-size", "2", "--reset-attention-mask")
    A.translate_args(args)
    assert args.create_attention_mask_in_dataloader is False
    stock = parse("--tensor-model-parallel-size", "2", "--reset-attention-mask")
    A.translate_args(stock)
    assert stock.create_attention_mask_in_dataloader is True
    args = parse(
        "--tensor-sequence-parallel-size",
        "2",
        "--reset-attention-mask",
        "--pipeline-model-parallel-size",
        "2",
    )
    with pytest.raises(A.TSPArgumentError) as err:
        A.translate_args(args)
    assert str(err.value).startswith(
        "--reset-attention-mask with --pipeline-model-parallel-size=2 cannot be combined with "
        "--tensor-sequence-parallel-size=2: Megatron gives the later pipeline stages only"
    ), err.value
    assert args.spec is None  # nothing translated


@pytest.mark.parametrize("bad", ["0", "-2"])
def test_bad_size(bad):
    args = parse("--tensor-sequence-parallel-size", bad)
    with pytest.raises(A.TSPArgumentError, match="positive integer"):
        A.translate_args(args)


def _validated(d=4, **fields):
    args = parse("--tensor-sequence-parallel-size", str(d))
    A.translate_args(args)
    base = dict(
        world_size=16,
        num_attention_heads=32,
        hidden_size=4096,
        ffn_hidden_size=16384,
        seq_length=4096,
        padded_vocab_size=32768,
    )
    base.update(fields)
    for k, v in base.items():
        setattr(args, k, v)
    return args


def test_validated_args_pass():
    A.check_validated_args(_validated())
    for groups in (8, 2, 1):  # a multiple of D=4, or fewer K/V heads than D (shared heads)
        A.check_validated_args(_validated(group_query_attention=True, num_query_groups=groups))


@pytest.mark.parametrize(
    "fields,named",
    [
        (dict(world_size=6), "world size 6"),
        (dict(num_attention_heads=30, hidden_size=3840), "--num-attention-heads=30"),
        (dict(group_query_attention=True, num_query_groups=3), "--num-query-groups=3"),
        (dict(ffn_hidden_size=16383), "--ffn-hidden-size=16383"),
        (dict(seq_length=4100), "--seq-length=4100"),
        (dict(sequence_parallel=False), "--sequence-parallel"),
        (dict(tensor_model_parallel_size=2), "--tensor-model-parallel-size"),
    ],
)
def test_validated_args_errors(fields, named):
    args = _validated(**fields)
    with pytest.raises(A.TSPArgumentError) as err:
        A.check_validated_args(args)
    assert named in str(err.value)


@pytest.mark.parametrize(
    "flag,dest",
    [
        ("--tsp-kv-grad-reduce-in-fp32", "tsp_kv_grad_reduce_in_fp32"),
        ("--tsp-kv-grad-all-to-all", "tsp_kv_grad_all_to_all"),
    ],
)
def test_kv_grad_flags(flag, dest):
    """The dK/dV reduction flags: off by default, kept by the translation, refused by name
    without TSP (plain TP+SP, or --tsp-mlp, which keeps Megatron's attention)."""
    assert getattr(parse("--tensor-sequence-parallel-size", "2"), dest) is False
    args = parse("--tensor-sequence-parallel-size", "2", flag)
    A.translate_args(args)
    assert getattr(args, dest) is True
    for argv in (
        ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
        ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--tsp-mlp"],
    ):
        with pytest.raises(A.TSPArgumentError, match=f"{flag} needs"):
            A.translate_args(parse(*argv, flag))


def test_activation_sums_flag(monkeypatch):
    """--tsp-activation-sums-in-fp32: off by default, kept under TSP and under --tsp-mlp (both
    have TSP MLPs), refused by name on a plain TP+SP run; the spec hands it to the layers."""
    from megatron_tsp.megatron_lm import spec as tsp_spec

    flag, dest = "--tsp-activation-sums-in-fp32", "tsp_activation_sums_in_fp32"
    assert getattr(parse("--tensor-sequence-parallel-size", "2"), dest) is False
    for argv in (
        ["--tensor-sequence-parallel-size", "2"],
        ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--tsp-mlp"],
    ):
        args = parse(*argv, flag)
        A.translate_args(args)
        assert getattr(args, dest) is True
    with pytest.raises(A.TSPArgumentError, match=f"{flag} needs"):
        A.translate_args(parse("--tensor-model-parallel-size", "2", "--sequence-parallel", flag))

    class Config:
        pass

    for given in (False, True):
        cfg = Config()
        args = parse("--tensor-sequence-parallel-size", "2", *([flag] if given else []))
        monkeypatch.setattr(tsp_spec, "_megatron_arg", lambda name: getattr(args, name, None))
        tsp_spec._activation_sums(cfg)
        assert getattr(cfg, dest, False) is given


def test_strip_tsp_flags():
    argv = [
        "--num-layers",
        "2",
        "--tensor-sequence-parallel-size",
        "8",
        "--tsp-dry-run",
        "--tsp-dry-run-world-size=16",
        "--tsp-dry-run-rank",
        "3",
        "--tsp-kv-grad-reduce-in-fp32",
        "--tsp-kv-grad-all-to-all",
        "--tsp-activation-sums-in-fp32",
        "--tsp-vocab-ring",
        "always",
        "--seq-length",
        "64",
    ]
    assert A.strip_tsp_flags(argv) == ["--num-layers", "2", "--seq-length", "64"]


def test_vocab_ring_flag():
    """``--tsp-vocab-ring auto`` (default: the ring where it receives fewer bytes), ``always``,
    ``never``; a forced choice only means something under TSP (refused by name elsewhere,
    --tsp-mlp included); other values are refused by the parser."""
    assert parse("--tensor-sequence-parallel-size", "2").tsp_vocab_ring == "auto"
    for choice in ("always", "never"):
        args = parse("--tensor-sequence-parallel-size", "2", "--tsp-vocab-ring", choice)
        A.translate_args(args)
        assert args.tsp_vocab_ring == choice
    for argv in (
        ["--tensor-model-parallel-size", "2", "--tsp-vocab-ring", "never"],
        ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--tsp-mlp"]
        + ["--tsp-vocab-ring", "always"],
    ):
        with pytest.raises(A.TSPArgumentError, match="--tsp-vocab-ring=.* needs --tensor-seq"):
            A.translate_args(parse(*argv))
    with pytest.raises(SystemExit):
        parse("--tensor-sequence-parallel-size", "2", "--tsp-vocab-ring", "on")


def test_checkpoints_store_a_stock_runs_args():
    from megatron_tsp.megatron_lm import checkpoint_args

    args = parse("--tensor-sequence-parallel-size", "4", "--spec", "my.module", "my_spec")
    A.translate_args(args)
    args.tsp_dry_run_world_size = 8

    def generate_state_dict(args_, model, optimizer, *rest, **kwargs):
        return {"args": args_, "model": model, "checkpoint_version": 3.0}

    wrapped = checkpoint_args.wrap_generate_state_dict(generate_state_dict)
    state = wrapped(args, "MODEL", None)
    stored = state["args"]
    assert state["model"] == "MODEL" and stored is not args
    assert stored.spec == ["my.module", "my_spec"]  # the user's own --spec
    assert stored.tensor_model_parallel_size == 4 and stored.sequence_parallel
    assert not [k for k in vars(stored) if checkpoint_args.is_tsp_only(k)]
    # the live args are untouched
    assert args.spec == [A.SPEC_MODULE, A.SPEC_ATTR] and args.tensor_sequence_parallel_size == 4
    # no user spec: None; a stock run's args pass through as they are
    plain = parse("--tensor-sequence-parallel-size", "2")
    A.translate_args(plain)
    assert wrapped(plain, None, None)["args"].spec is None
    stock = parse("--tensor-model-parallel-size", "2")  # the launcher without the TSP flag
    stored = wrapped(stock, None, None)["args"]
    assert {k: v for k, v in vars(stock).items() if not checkpoint_args.is_tsp_only(k)} == vars(
        stored
    )
    bare = argparse.Namespace(spec=None, tensor_model_parallel_size=2)  # Megatron without it
    assert wrapped(bare, None, None)["args"] is bare
    # any TSP spec (e.g. the --tsp-mlp hybrid's) and any tsp_* attribute is a TSP run's
    hybrid = parse("--tensor-model-parallel-size", "2")
    hybrid.spec, hybrid.tsp_mlp = [A.SPEC_MODULE, "tsp_mlp_block_spec"], True
    stored = wrapped(hybrid, None, None)["args"]
    assert stored.spec is None and not hasattr(stored, "tsp_mlp")


def test_tsp_moe_ring_translation_and_refusals():
    """--tsp-moe-ring: expert-TP left at (or set to) D, EP 1; any other expert layout, the flag
    without TSP or without experts, refused naming the flag and the numbers. Without the flag
    the folded schedule's expert-TP 1 is unchanged, and expert-TP D names the ring."""
    base = ["--tensor-sequence-parallel-size", "4", "--num-experts", "8"]
    args = parse(*base, "--tsp-moe-ring")
    A.translate_args(args)
    assert args.tsp_moe_ring is True and args.expert_tensor_parallel_size == 4
    args = parse(*base, "--tsp-moe-ring", "--expert-tensor-parallel-size", "4")
    A.translate_args(args)
    assert args.expert_tensor_parallel_size == 4
    args = parse(*base)
    A.translate_args(args)
    assert args.tsp_moe_ring is False and args.expert_tensor_parallel_size == 1
    with pytest.raises(A.TSPArgumentError, match="add --tsp-moe-ring"):
        A.translate_args(parse(*base, "--expert-tensor-parallel-size", "4"))
    for extra, named in (
        (["--expert-tensor-parallel-size", "2"], "--expert-tensor-parallel-size=2"),
        (["--expert-model-parallel-size", "2"], "--expert-model-parallel-size=2"),
    ):
        with pytest.raises(A.TSPArgumentError) as err:
            A.translate_args(parse(*base, "--tsp-moe-ring", *extra))
        assert named in str(err.value) and "--tsp-moe-ring" in str(err.value)
        assert "--tensor-sequence-parallel-size=4" in str(err.value)
    with pytest.raises(A.TSPArgumentError, match="--tsp-moe-ring .* needs --num-experts"):
        A.translate_args(parse("--tensor-sequence-parallel-size", "4", "--tsp-moe-ring"))
    with pytest.raises(A.TSPArgumentError, match="--tsp-moe-ring needs --tensor-sequence"):
        A.translate_args(
            parse("--tensor-model-parallel-size", "4", "--num-experts", "8", "--tsp-moe-ring")
        )
    args = _validated(num_experts=8, expert_model_parallel_size=1)
    args.tsp_moe_ring, args.expert_tensor_parallel_size = True, 4
    A.check_validated_args(args)
    args.expert_tensor_parallel_size = 1
    with pytest.raises(A.TSPArgumentError, match="--expert-tensor-parallel-size=1"):
        A.check_validated_args(args)
    assert A.strip_tsp_flags(["--tsp-moe-ring", "--num-layers", "2"]) == ["--num-layers", "2"]
