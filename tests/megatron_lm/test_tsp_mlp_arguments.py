"""``--tsp-mlp`` (TP+SP attention + TSP MLP): parsing, translation, the rejection table."""

import pytest

from megatron_tsp.core import rejections
from megatron_tsp.megatron_lm import arguments as A
from tests.megatron_lm.common import megatron_parser


def parse(*argv):
    return megatron_parser().parse_args(list(argv))


HYBRID = ("--tensor-model-parallel-size", "4", "--sequence-parallel", "--tsp-mlp")


def test_flag_is_beside_the_tsp_flag_in_help():
    text = megatron_parser().format_help()
    group = text.split("tensor-sequence parallel:")[1]
    assert "--tsp-mlp" in group and "--tensor-sequence-parallel-size D" in group
    assert parse().tsp_mlp is False and parse("--tsp-mlp").tsp_mlp is True


def test_translation_keeps_layout_and_selects_hybrid_spec():
    args = parse(*HYBRID, "--num-attention-heads", "8")
    A.translate_args(args)
    assert args.tensor_model_parallel_size == 4 and args.sequence_parallel is True
    assert args.spec == [A.SPEC_MODULE, A.TSP_MLP_SPEC_ATTR]
    assert args.tensor_sequence_parallel_size is None  # TSP itself (zigzag batches) stays off
    from megatron_tsp.megatron_lm import spec

    assert spec.is_tsp_spec(getattr(spec, A.TSP_MLP_SPEC_ATTR))


def test_user_spec_is_replaced_and_recorded():
    args = parse(*HYBRID, "--spec", "local")
    A.translate_args(args)
    assert args.spec == [A.SPEC_MODULE, A.TSP_MLP_SPEC_ATTR]
    assert args.tsp_replaced_spec == ["local"]


def test_tp_one_is_accepted():
    """A group of one: the ring has one shard (the stock MLP's arithmetic)."""
    args = parse("--tsp-mlp")
    A.translate_args(args)
    assert args.spec == [A.SPEC_MODULE, A.TSP_MLP_SPEC_ATTR]


def test_without_sequence_parallel_is_refused():
    args = parse("--tensor-model-parallel-size", "4", "--tsp-mlp")
    with pytest.raises(A.TSPArgumentError) as err:
        A.translate_args(args)
    assert "--sequence-parallel" in str(err.value) and "--tensor-model-parallel-size=4" in str(
        err.value
    )
    assert args.spec is None


REFUSED = [
    (["--tensor-sequence-parallel-size", "4"], "--tensor-sequence-parallel-size=4"),
    (["--num-experts", "8"], "--num-experts=8"),
    (["--expert-model-parallel-size", "2"], "--expert-model-parallel-size=2"),
    (["--context-parallel-size", "2"], "--context-parallel-size=2"),
    (["--hierarchical-context-parallel-sizes", "2", "2"], "--hierarchical-context-parallel-sizes"),
    (["--hybrid-context-parallel"], "--hybrid-context-parallel"),
    (["--tp-comm-overlap"], "--tp-comm-overlap"),
    (["--tensor-parallel-num-weight-shards", "2"], "--tensor-parallel-num-weight-shards=2"),
    (["--multi-latent-attention"], "--multi-latent-attention"),
    (["--qk-layernorm"], "--qk-layernorm"),
    (["--use-legacy-models"], "--use-legacy-models"),
    (["--mtp-num-layers", "1"], "--mtp-num-layers=1"),
    (["--experimental-attention-variant", "dsa"], "--experimental-attention-variant=dsa"),
    (["--heterogeneous-layers-config-path", "x.json"], "--heterogeneous-layers-config-path"),
    (["--yaml-cfg", "x.yaml"], "--yaml-cfg=x.yaml"),
    (["--fp8-format", "hybrid"], "--fp8-format=hybrid"),
    (["--fp4-format", "e2m1"], "--fp4-format=e2m1"),
    (["--attention-backend", "flash"], "--attention-backend=flash"),
    (["--transformer-impl", "inference_optimized"], "--transformer-impl=inference_optimized"),
    (["--use-megatron-fsdp"], "--use-megatron-fsdp"),
    (["--use-torch-fsdp2"], "--use-torch-fsdp2"),
    (["--enable-cuda-graph"], "--enable-cuda-graph"),
    (["--external-cuda-graph"], "--external-cuda-graph"),
    (["--cuda-graph-impl", "local"], "--cuda-graph-impl=local"),
]


@pytest.mark.parametrize("extra,named", REFUSED, ids=[r[1] for r in REFUSED])
def test_refused_flags_are_named(extra, named):
    args = parse(*HYBRID, *extra)
    with pytest.raises(A.TSPArgumentError) as err:
        A.translate_args(args)
    assert named in str(err.value) and "--tsp-mlp" in str(err.value)
    assert args.spec is None


def test_every_rejection_row_is_tested():
    tested = {named.split("=")[0] for _, named in REFUSED}
    rows = {r.flag for r in rejections.rows(rejections.TSP_MLP, stage=rejections.PARSED)}
    assert rows == tested


@pytest.mark.parametrize(
    "extra", [[], ["--attention-backend", "local"], ["--reset-attention-mask"], ["--sft"]]
)
def test_flags_megatron_handles_stay_accepted(extra):
    """The hybrid's attention, data path and batches are Megatron's: TSP-only refusals (masks,
    packed sequences, the local attention backend) do not apply."""
    args = parse(*HYBRID, *extra)
    A.translate_args(args)
    assert args.spec == [A.SPEC_MODULE, A.TSP_MLP_SPEC_ATTR]


@pytest.mark.parametrize(
    "fields,named",
    [
        (dict(sequence_parallel=False), "--sequence-parallel"),
        (dict(ffn_hidden_size=16383), "--ffn-hidden-size=16383"),
    ],
)
def test_validated_args_errors(fields, named):
    args = parse(*HYBRID)
    A.translate_args(args)
    args.ffn_hidden_size = 16384
    for k, v in fields.items():
        setattr(args, k, v)
    with pytest.raises(A.TSPArgumentError) as err:
        A.check_validated_args(args)
    assert named in str(err.value)


def test_strip_removes_the_flag():
    assert A.strip_tsp_flags(["--tsp-mlp", "--num-layers", "2"]) == ["--num-layers", "2"]
