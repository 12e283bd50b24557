"""``megatron-tsp generate``: TSP prefill + Megatron TP=D decode from the command line.

Without ``--load`` it uses the embedded tiny model (Llama-style, char-level vocabulary of 128),
trained for ``--train-steps`` steps on the embedded corpus under TSP so its output is readable.
With ``--load DIR`` it loads a megatron-core ``torch_dist`` checkpoint (Megatron-LM's ``--save``
layout, state under ``model``; saved under TP=D + SP or under TSP-D: they are the same) whose
architecture comes from ``--config`` (a ``configs/*.json`` file) or from the Megatron-LM
arguments stored in the checkpoint, every math-changing one read through
``megatron_lm/model_args.py`` (RoPE scaling / interpolation / interleaving, GQA, norms, biases...).
With ``--hf DIR`` it reads a Hugging Face Llama / Mistral / Qwen2 directory
(``models/hf_import.py``; each rank reads only its slices); ``--save OUT`` then writes it as a
Megatron torch_dist checkpoint (``--load`` here, ``--load`` / ``--finetune`` in pretrain_gpt.py).

On a CPU machine it spawns D gloo ranks; under ``torchrun`` (``WORLD_SIZE`` set) it uses the
launched ranks (NCCL when CUDA is available). Prints the generated tokens, the prefill and decode
throughput separately, and (``--check-tp``) whether a TP=D prefill produces the same tokens.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import time

import torch
import torch.distributed as dist

from megatron_tsp.console.args import (
    ToolParser,
    UsageError,
    debug,
    existing_dir,
    fraction,
    from_value_error,
    non_negative_float,
    non_negative_int,
    positive_float,
    positive_int,
)
from megatron_tsp.megatron_lm import patches
from megatron_tsp.megatron_lm.cpu_runner import free_port
from megatron_tsp.tools.cpu_ranks import init_gloo_rank, unfused_config

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


def parse_args(argv=None) -> argparse.Namespace:
    p = ToolParser(prog="megatron-tsp generate", description=__doc__.splitlines()[0])
    p.add_argument(
        "--tensor-sequence-parallel-size", "--tsp", dest="d", type=positive_int, default=2
    )
    p.add_argument(
        "--load",
        type=existing_dir,
        default=None,
        help="torch_dist checkpoint directory (iteration "
        "directory or a root with latest_checkpointed_iteration.txt)",
    )
    p.add_argument(
        "--config", default=None, help="run config (configs/*.json: name or path) for --load"
    )
    p.add_argument(
        "--hf",
        type=existing_dir,
        default=None,
        help="Hugging Face Llama / Mistral / Qwen2 checkpoint directory (config.json + "
        "safetensors; a local path): each rank reads only its own slices",
    )
    p.add_argument(
        "--prompt",
        action="append",
        default=None,
        help="prompt text (byte tokens; repeat for a batch)",
    )
    p.add_argument(
        "--prompt-ids",
        action="append",
        default=None,
        help="prompt as comma-separated token ids (repeat for a batch)",
    )
    p.add_argument(
        "--random-prompt-tokens",
        type=non_negative_int,
        default=0,
        help="use one random prompt of this many tokens (throughput runs)",
    )
    p.add_argument(
        "--max-new-tokens",
        type=non_negative_int,
        default=48,
        help="0 only with --save: a conversion run that generates nothing",
    )
    p.add_argument("--temperature", type=non_negative_float, default=0.0)
    p.add_argument("--top-k", type=non_negative_int, default=0)
    p.add_argument("--top-p", type=fraction, default=1.0)
    p.add_argument("--seed", type=non_negative_int, default=1234)
    p.add_argument("--stop", default=None, help="stop token ids, comma-separated (text: '.')")
    p.add_argument("--prefill", choices=["auto", "tsp", "tp"], default="auto")
    p.add_argument("--prefill-chunk-tokens", type=positive_int, default=None)
    p.add_argument(
        "--check-tp",
        action="store_true",
        help="also prefill under Megatron TP=D and compare the tokens",
    )
    p.add_argument(
        "--train-steps",
        type=non_negative_int,
        default=150,
        help="embedded model only: TSP training steps on the embedded corpus",
    )
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument(
        "--save",
        default=None,
        help="embedded model only: write it as a Megatron-LM torch_dist checkpoint "
        "(iter_0000001/, latest_checkpointed_iteration.txt, args in common.pt)",
    )
    tiny = p.add_argument_group(
        "embedded model only", "Megatron-LM's RoPE flags, stored in the --save checkpoint's args"
    )
    tiny.add_argument("--use-rope-scaling", action="store_true")
    tiny.add_argument("--rope-scaling-factor", type=positive_float, default=8.0)
    tiny.add_argument("--rotary-seq-len-interpolation-factor", type=positive_float, default=None)
    tiny.add_argument("--rotary-base", type=positive_int, default=10000)
    args = p.parse_args(argv)  # types only: the checks below need the combination
    if args.config and not args.load:
        p.error("--config describes a checkpoint: pass --load too")
    if args.save and args.load:
        p.error("--save writes the embedded or --hf model: it cannot be combined with --load")
    if args.hf and (args.load or args.config):
        p.error("--hf reads a Hugging Face directory: it cannot be combined with --load / --config")
    if args.max_new_tokens == 0 and not args.save:
        p.error("--max-new-tokens 0 generates nothing: give a positive number, or 0 with --save")
    try:
        check_model(args)
    except UsageError as exc:
        if debug():
            raise
        p.error(str(exc))
    return args


def check_model(args) -> None:
    """The model must split over D before any rank is spawned: the embedded model's or the
    ``--load`` checkpoint's shape (its arguments or ``--config``) through the validation module
    (``--hf`` directories are checked field by field by ``models/hf_import.py``)."""
    if args.hf:
        return
    from megatron_tsp.core.validation import check_model_shape
    from megatron_tsp.megatron_lm.model_args import from_megatron_args

    try:
        c = from_megatron_args(tiny_args(args) if args.load is None else _model_fields(args)).config
        check_model_shape(
            args.d,
            num_attention_heads=c["num_attention_heads"],
            num_query_groups=c.get("num_query_groups"),
            ffn_hidden_size=c.get("ffn_hidden_size"),
            hidden_size=c.get("hidden_size"),
            kv_channels=c.get("kv_channels"),
        )
    except ValueError as exc:
        where = "" if args.load is None else f" (--load {args.load})"
        raise from_value_error(exc, "--tensor-sequence-parallel-size" + where) from exc


# ------------------------------------------------------------------ models
def _config_from_model_fields(m: dict, d: int, dtype, initialise: bool = False):
    """TransformerConfig, GPTModel arguments, vocabulary and length from Megatron-LM argument
    names (a configs/*.json "model" block or the args namespace stored in a checkpoint), through
    the one mapping every reader uses (``megatron_lm/model_args.py``)."""
    from megatron_tsp.megatron_lm.model_args import from_megatron_args

    described = from_megatron_args(m)
    config = unfused_config(
        d,
        dtype,
        use_cpu_initialization=not torch.cuda.is_available(),
        perform_initialization=initialise,
        **described.config,
    )
    return config, described


def _checkpoint_dir(path: str) -> str:
    tracker = os.path.join(path, "latest_checkpointed_iteration.txt")
    if os.path.exists(tracker):
        it = open(tracker).read().strip()
        return os.path.join(path, "release" if it == "release" else f"iter_{int(it):07d}")
    return path


def _model_fields(args) -> dict:
    if args.config:
        from megatron_tsp.megatron_lm.configs import load_config

        return load_config(args.config)["model"]
    # The non-sharded part of a torch_dist checkpoint (Megatron-LM's ``args``): common.pt in
    # megatron-core 0.16, inside the checkpoint's own files in 0.19; read through megatron-core's
    # own loader so both layouts work.
    from megatron.core import dist_checkpointing

    path = _checkpoint_dir(args.load)
    try:
        with _cpu_cuda_sync():
            common = dist_checkpointing.load_common_state_dict(path)
    except Exception as exc:  # noqa: BLE001 - any unreadable checkpoint gets the same advice
        raise UsageError(
            f"--load {args.load}",
            f"cannot read the checkpoint's common state ({type(exc).__name__}: {exc}); "
            "pass --config",
        ) from exc
    saved = (common or {}).get("args")
    if saved is None:
        raise UsageError(
            f"--load {args.load}", "the checkpoint holds no Megatron-LM 'args'; pass --config"
        )
    return vars(saved)


def _build(args, device):
    from megatron_tsp.core.model import build_tsp_gpt_model

    dtype = DTYPES[args.dtype]
    if args.hf:
        from megatron_tsp.models import hf_import

        try:
            model, desc = hf_import.build_model(args.hf, args.d, dtype, device)
        except (ValueError, FileNotFoundError) as exc:
            raise SystemExit(f"--hf {args.hf}: {exc}") from exc
        return model, desc.gpt, desc.megatron_args
    if args.load is None:
        # The embedded model is described by the Megatron-LM arguments --save stores with it,
        # through the same mapping --load reads them with.
        config, described = _config_from_model_fields(
            tiny_args(args), args.d, dtype, initialise=True
        )
        model = build_tsp_gpt_model(
            config,
            vocab_size=described.vocab_size,
            max_sequence_length=described.max_sequence_length,
            seq_length=TINY_ARGS["seq_length"],
            **described.gpt,
        )
        return model.to(device), described.gpt, None
    m = _model_fields(args)
    try:
        config, described = _config_from_model_fields(m, args.d, dtype)
    except ValueError as exc:
        raise SystemExit(f"--load {args.load}: {exc}") from exc
    kwargs = described.gpt
    seq = described.max_sequence_length
    step = 2 * args.d
    model = build_tsp_gpt_model(
        config,
        vocab_size=described.vocab_size,
        max_sequence_length=seq,
        seq_length=seq // step * step,
        **kwargs,
    ).to(device)
    _load_torch_dist(model, _checkpoint_dir(args.load))
    return model, kwargs, m


TINY_ARGS = dict(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    group_query_attention=True,
    num_query_groups=2,
    ffn_hidden_size=128,
    normalization="RMSNorm",
    swiglu=True,
    disable_bias_linear=True,
    position_embedding_type="rope",
    untie_embeddings_and_output_weights=True,
    vocab_size=128,
    padded_vocab_size=128,
    max_position_embeddings=256,
    seq_length=64,
)


def tiny_args(args) -> dict:
    """The embedded model's Megatron-LM arguments, with the RoPE options given on the command line
    (what a training run with the same flags stores in its checkpoints)."""
    out = dict(TINY_ARGS)
    out.update(
        use_rope_scaling=args.use_rope_scaling,
        rope_scaling_factor=args.rope_scaling_factor,
        rotary_seq_len_interpolation_factor=args.rotary_seq_len_interpolation_factor,
        rotary_base=args.rotary_base,
    )
    return out


def _save_torch_dist(model, root: str, stored_args: dict) -> None:
    """The embedded model as Megatron-LM saves a checkpoint: state under ``model`` (sharded, the
    TP=D layout), the Megatron-LM arguments in ``common.pt``, the iteration tracker file."""
    from megatron.core import dist_checkpointing

    path = os.path.join(root, "iter_0000001")
    if dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(root, "latest_checkpointed_iteration.txt"), "w") as f:
            f.write("1")
    dist.barrier()
    state = {
        "model": model.sharded_state_dict(),
        "args": argparse.Namespace(**stored_args),
        "iteration": 1,
    }
    with _cpu_cuda_sync():
        dist_checkpointing.save(state, path)


_CUDA_SYNC = patches.declare(
    [
        patches.row(
            patches.GENERATE,
            "torch.cuda:synchronize",
            "torch_dist's reader and writer synchronize the CUDA stream; nothing to wait for on "
            "CPU",
            patches.DEVICE_PARAM,
        )
    ]
)[0]


@contextlib.contextmanager
def _cpu_cuda_sync():
    """torch_dist's reader / writer synchronize the CUDA stream; on a CPU-only torch there is
    nothing to wait for."""
    if torch.cuda.is_available():
        yield
        return
    with patches.applied(_CUDA_SYNC.mode, _CUDA_SYNC.target, lambda *a, **k: None):
        yield


def _load_torch_dist(model, path: str) -> None:
    from megatron.core import dist_checkpointing

    sharded = {"model": model.sharded_state_dict()}
    with _cpu_cuda_sync():
        loaded = dist_checkpointing.load(sharded, path)
    missing, unexpected = model.load_state_dict(loaded["model"], strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing:
        raise SystemExit(f"--load {path}: checkpoint lacks {missing[:5]}")


def _train_tiny(model, args, group) -> float:
    """A few TSP training steps on the embedded corpus (so generations are readable)."""
    from megatron_tsp.core import zigzag
    from megatron_tsp.core.sharding import allreduce_sequence_parallel_grads
    from megatron_tsp.tools.data import batches

    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    data = batches(8, 64, seed=args.seed)
    loss = float("nan")
    size = dist.get_world_size(group)
    for _ in range(args.train_steps):
        batch = zigzag.get_batch_on_this_tsp_rank(next(data), size)
        opt.zero_grad(set_to_none=True)
        losses = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
        total = losses.float().mean()
        total.backward()
        allreduce_sequence_parallel_grads(model, group)
        opt.step()
        dist.all_reduce(total, group=group)
        loss = total.item() / size
    model.eval()
    return loss


# ------------------------------------------------------------------ run
def _prompts(args, vocab: int, tok=None):
    if args.random_prompt_tokens:
        g = torch.Generator().manual_seed(args.seed)
        return [torch.randint(0, vocab, (args.random_prompt_tokens,), generator=g).tolist()], False
    if args.prompt_ids:
        return [[int(t) for t in s.replace(",", " ").split()] for s in args.prompt_ids], False
    texts = args.prompt or ["the cat sees a red ball. my friend "]
    if tok is not None:
        return [tok.encode(t).ids for t in texts], True
    return [list(t.encode("utf-8")) for t in texts], True


def run(rank: int, args) -> int:
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_tsp.core import parallel_state
    from megatron_tsp.inference import SamplingParams, TSPInferenceEngine

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    if not cuda:
        from megatron_tsp.megatron_lm.cpu_support import enable_cpu_support

        enable_cpu_support()
    parallel_state.initialize_model_parallel(
        tensor_sequence_parallel_size=args.d, create_gloo_process_groups=False
    )
    model_parallel_cuda_manual_seed(args.seed)
    group = parallel_state.get_tensor_sequence_parallel_group()
    model, kwargs, megatron_args = _build(args, device)
    say = (lambda *a: print(*a, flush=True)) if rank == 0 else (lambda *a: None)
    say("model: " + ", ".join(f"{k}={v}" for k, v in sorted(kwargs.items())))
    if args.load is None and args.hf is None and args.train_steps > 0:
        start = time.perf_counter()
        loss = _train_tiny(model, args, group)
        say(
            f"embedded tiny model: {args.train_steps} TSP training steps on the embedded corpus, "
            f"loss {loss:.3f} ({time.perf_counter() - start:.1f} s)"
        )
    if args.save:
        stored = megatron_args if args.hf else tiny_args(args)
        _save_torch_dist(model, args.save, stored)
        what = f"the model of {args.hf}" if args.hf else "the embedded model"
        say(f"saved {what} (Megatron torch_dist, TP={args.d} layout) to {args.save}")
        if args.max_new_tokens == 0:
            return 0  # a conversion run: nothing to generate
    engine = TSPInferenceEngine(model)  # reads the GPTModel arguments the builder recorded
    tok = None
    if args.hf:
        from megatron_tsp.models import hf_import

        tok = hf_import.tokenizer(args.hf)
        if tok is None and not (args.prompt_ids or args.random_prompt_tokens):
            say(f"error: {args.hf} has no tokenizer.json for text prompts: pass --prompt-ids")
            return 2
    prompts, is_text = _prompts(args, engine.vocab_size, tok)
    if args.stop:
        stops = [int(t) for t in args.stop.split(",")]
    elif args.hf:
        stops = hf_import.stop_tokens(hf_import.read_config(args.hf)) if is_text else []
    else:
        stops = [ord(".")] if is_text else []
    sampling = SamplingParams(
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed
    )
    try:
        result = engine.generate(
            prompts,
            args.max_new_tokens,
            sampling,
            stops,
            prefill=args.prefill,
            prefill_chunk_tokens=args.prefill_chunk_tokens,
        )
    except ValueError as exc:
        say(f"error: {exc}")
        return 2
    show = (
        (lambda ids: repr(tok.decode(ids) if tok else bytes(ids).decode("utf-8", "replace")))
        if is_text
        else (
            lambda ids: (
                " ".join(map(str, ids)) if len(ids) <= 32 else " ".join(map(str, ids[:32])) + " ..."
            )
        )
    )
    say(
        f"D={args.d}, prefill={result.prefill_mode}, {len(prompts)} prompt(s) of "
        f"{[len(p) for p in prompts]} tokens"
    )
    for i, p in enumerate(prompts):
        say(f"[{i}] {show(p)} -> {show(result.tokens[i])}")
    say(
        f"prefill: {result.prefill_tokens} tokens in {result.prefill_seconds:.3f} s = "
        f"{result.prefill_tokens_per_s:,.0f} tokens/s | decode: {result.decode_tokens} tokens in "
        f"{result.decode_seconds:.3f} s = {result.decode_tokens_per_s:,.0f} tokens/s"
    )
    rc = 0
    if args.check_tp:
        tp = engine.generate(prompts, args.max_new_tokens, sampling, stops, prefill="tp")
        same = tp.tokens == result.tokens
        err = (
            (tp.prefill_logits - result.prefill_logits).abs().max() / tp.prefill_logits.abs().max()
        ).item()
        say(
            f"TP=D prefill check: tokens {'identical' if same else 'DIFFER'}, last-token logits "
            f"max rel diff {err:.1e}"
        )
        rc = 0 if same else 1
    return rc


def _spawned(rank: int, args, port: int) -> None:
    init_gloo_rank(rank, args.d, port, timeout_s=300)
    try:
        rc = run(rank, args)
    finally:
        from megatron_tsp.core import parallel_state

        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()
    if rc:
        sys.exit(rc)


def main(argv=None) -> int:
    args = parse_args(argv)
    if "WORLD_SIZE" in os.environ:  # torchrun
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend)
        rc = run(dist.get_rank(), args)
        dist.destroy_process_group()
        return rc
    import torch.multiprocessing as mp

    try:
        mp.spawn(_spawned, args=(args, free_port()), nprocs=args.d, join=True)
    except mp.ProcessExitedException as exc:
        return exc.exit_code or 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
