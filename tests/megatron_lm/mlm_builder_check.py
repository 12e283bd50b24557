"""TSP model built by Megatron-LM's own argument code and builder vs the stock model, on CPU.

    python mlm_builder_check.py MEGATRON_LM_PATH OUT_JSON SEED

Two gloo ranks. On each: the launcher's hooks are installed, Megatron's ``parse_args`` /
``validate_args`` read a real pretrain_gpt.py command line with ``--tensor-sequence-parallel-size
2`` (translated by the hooks), Megatron's model-parallel groups are made by
``megatron.core.parallel_state.initialize_model_parallel`` from the validated args, and the
checkout's ``gpt_builders.gpt_builder`` builds the model (TSP spec through ``--spec``). The same
builder builds the stock model from the same command line with ``--tensor-model-parallel-size 2``
(local spec; sequence parallelism off, because Megatron's CPU norm refuses it: SP changes no
parameter). The stock weights are loaded into the TSP model (``strict=True``); one forward of
Megatron's loss on the same batch — zigzagged by the hooked ``get_batch_on_this_cp_rank`` for TSP —
must give the same loss sum and token count.
"""

import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STYLES = {
    "gpt2": ["--normalization", "LayerNorm", "--position-embedding-type", "learned_absolute"],
    "llama": [
        "--normalization",
        "RMSNorm",
        "--position-embedding-type",
        "rope",
        "--swiglu",
        "--group-query-attention",
        "--num-query-groups",
        "2",
        "--disable-bias-linear",
        "--untie-embeddings-and-output-weights",
    ],
}
COMMON = [
    "--num-layers",
    "2",
    "--hidden-size",
    "64",
    "--num-attention-heads",
    "4",
    "--ffn-hidden-size",
    "128",
    "--seq-length",
    "64",
    "--max-position-embeddings",
    "64",
    "--micro-batch-size",
    "2",
    "--global-batch-size",
    "2",
    "--train-iters",
    "1",
    "--lr",
    "1e-4",
    "--mock-data",
    "--tokenizer-type",
    "NullTokenizer",
    "--vocab-size",
    "255",
    "--transformer-impl",
    "local",
    "--no-persist-layer-norm",
    # Megatron-LM's default fusions stay on (fused bias-GeLU / SwiGLU, bias-dropout,
    # masked softmax); these two need CUDA extensions (apex / Transformer Engine):
    "--no-gradient-accumulation-fusion",
    "--no-rope-fusion",
    "--attention-dropout",
    "0",
    "--hidden-dropout",
    "0",
]


def _parse(argv):
    from megatron.training import arguments

    saved = sys.argv
    sys.argv = ["pretrain_gpt.py"] + argv
    try:
        args = arguments.parse_args()
    finally:
        sys.argv = saved
    args.world_size, args.rank = 2, int(os.environ["RANK"])
    arguments.validate_args(args, {"tokenizer_type": "GPT2BPETokenizer"})
    return args


def _build(args, seed):
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel
    from megatron.training import global_vars

    global_vars.unset_global_variables() if hasattr(global_vars, "unset_global_variables") else None
    global_vars.set_global_variables(args)
    mpu.destroy_model_parallel()
    from megatron_tsp.core import parallel_state as tsp_ps

    tsp_ps.destroy_model_parallel()
    mpu.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size, create_gloo_process_groups=False
    )
    tensor_parallel.model_parallel_cuda_manual_seed(seed)
    import gpt_builders

    assert dist.get_world_size(mpu.get_tensor_model_parallel_group()) == 2
    return gpt_builders.gpt_builder(args, True, True)


def _worker(rank, port, checkout, out, seed):
    os.environ.update(
        RANK=str(rank), WORLD_SIZE="2", CUDA_DEVICE_MAX_CONNECTIONS="1", OMP_NUM_THREADS="1"
    )
    sys.path[:0] = [checkout, REPO]
    import torch
    import torch.distributed as dist

    from megatron_tsp.tools.cpu_ranks import init_gloo_rank

    init_gloo_rank(rank, 2, port, timeout_s=180)
    from megatron_tsp.megatron_lm import install
    from megatron_tsp.megatron_lm.cpu_support import enable_cpu_support

    enable_cpu_support()
    install()
    import megatron.core.utils as core_utils
    import megatron.training.arguments as arguments
    import megatron.training.utils as training_utils

    # where this version's pretrain_gpt.py imports it from (core_v0.16: training.utils)
    cp_batch = (
        getattr(training_utils, "get_batch_on_this_cp_rank", None)
        or core_utils.get_batch_on_this_cp_rank
    )
    import inspect

    needs_cp_group = "is_hybrid_cp" in inspect.signature(cp_batch).parameters
    from megatron_tsp.core.layers.attention import TSPSelfAttention
    from megatron_tsp.megatron_lm import dry_run

    arguments.get_device_arch_version = dry_run.dry_run_arch  # CPU: no device to ask
    results = {}
    for style, flags in STYLES.items():
        stock_args = _parse(COMMON + flags + ["--tensor-model-parallel-size", "2"])
        stock = _build(stock_args, seed)
        tsp_args = _parse(COMMON + flags + ["--tensor-sequence-parallel-size", "2"])
        assert tsp_args.tensor_model_parallel_size == 2 and tsp_args.sequence_parallel
        tsp = _build(tsp_args, seed + 5)
        assert isinstance(tsp.decoder.layers[0].self_attention, TSPSelfAttention)
        assert not isinstance(stock.decoder.layers[0].self_attention, TSPSelfAttention)
        tsp.load_state_dict(stock.state_dict(), strict=True)

        g = torch.Generator().manual_seed(seed)
        vocab = stock_args.padded_vocab_size
        s, b = stock_args.seq_length, stock_args.micro_batch_size
        batch = dict(
            tokens=torch.randint(0, 255, (b, s), generator=g),
            labels=torch.randint(0, 255, (b, s), generator=g),
            loss_mask=(torch.rand(b, s, generator=g) > 0.2).float(),
            attention_mask=torch.triu(torch.ones(s, s, dtype=torch.bool), 1)
            .expand(b, 1, s, s)
            .contiguous(),
            position_ids=torch.arange(s).expand(b, s).contiguous(),
        )
        sums = {}
        for name, model in (("stock", stock), ("tsp", tsp)):
            from megatron_tsp.megatron_lm import batch as batch_hook

            cp_kwargs = {}
            if needs_cp_group:  # 0.19 / main: called as pretrain_gpt.get_batch does
                from megatron.core import parallel_state as mpu

                cp_kwargs = dict(is_hybrid_cp=False, cp_group=mpu.get_context_parallel_group())
            batch_hook.activate(2 if name == "tsp" else None)
            local = cp_batch(dict(batch), **cp_kwargs)  # the hooked path
            batch_hook.activate(None)
            assert local["tokens"].shape == batch["tokens"].shape, local["tokens"].shape
            with torch.no_grad():
                losses = model(
                    local["tokens"],
                    local["position_ids"],
                    local["attention_mask"],
                    labels=local["labels"],
                )
            mask = local["loss_mask"].view(-1).float()
            sums[name] = (torch.sum(losses.view(-1).float() * mask).item(), int(mask.sum()))
        rel = abs(sums["tsp"][0] - sums["stock"][0]) / abs(sums["stock"][0])
        results[style] = {"rel": rel, "tokens": [sums["tsp"][1], sums["stock"][1]], "vocab": vocab}
    with open(f"{out}.rank{rank}", "w") as f:
        json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


def main(checkout, out, seed):
    import torch.multiprocessing as mp

    sys.path.insert(0, REPO)
    from megatron_tsp.megatron_lm.cpu_runner import free_port

    mp.spawn(_worker, args=(free_port(), checkout, out, seed), nprocs=2, join=True)
    merged = [json.load(open(f"{out}.rank{r}")) for r in range(2)]
    with open(out, "w") as f:
        json.dump(merged, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
