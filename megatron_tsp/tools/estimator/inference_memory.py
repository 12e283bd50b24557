"""``megatron-tsp prefill-memory``: one rank's peak memory for a long-prompt prefill, measured.

Runs one rank of the real prefill code under ``FakeTensorMode`` and torch's ``fake`` process group
(shapes only, no storage; collectives return at once), with the estimator's MemTracker
(``megatron_tsp.tools.estimator.fake_run``), for three ways to prefill S prompt tokens on D GPUs:

* ``tsp``: TSP prefill (``megatron_tsp.inference``): weights 1/D, activations 1/D, one head
  group's full K/V alive at a time; the KV cache of this rank's head groups for all S tokens.
* ``tp``: Megatron TP=D static-context prefill (no sequence parallelism, as Megatron's inference
  runs): weights 1/D, full-sequence activations, the same KV cache.
* ``cp``: context parallelism CP=D (TP=1, Megatron's zigzag layout, K/V all-gathered per layer):
  full weights, activations 1/D, a KV cache of all heads for this rank's S/D tokens.

The KV cache is included (allocated up front for S tokens, like ``StaticInferenceContext``);
logits are for the last token only (a [b, V/D] row, negligible). Attention everywhere uses the
estimator's flash-equivalent kernel (output + log-sum-exp, no S x S scores). Batch 1 by default.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from typing import Optional, Sequence

import torch

from megatron_tsp.console.args import ToolParser, positive_int, positive_int_list
from megatron_tsp.core.model_shape import load_model

SCHEMES = ("tsp", "tp", "cp")


def _run_config(scheme: str, size: int, seq: int, model, batch: int, dtype: str, fake: bool):
    from megatron_tsp.tools.estimator.fake_run import RunConfig

    if scheme not in SCHEMES:
        raise ValueError(f"--scheme {scheme!r}: must be one of {SCHEMES}")
    return RunConfig(
        scheme="tp_cp" if scheme == "cp" else scheme,  # CP alone: the fake run's TP x CP, TP 1
        model=model,
        world_size=size,
        tp=1 if scheme == "cp" else size,
        cp=size if scheme == "cp" else 1,
        seq=seq,
        micro_batch=batch,
        dtype=dtype,
        fake=fake,
        count_flops=False,
        count_comm=False,
    )


@contextlib.contextmanager
def _flash_prefill_attention(enabled: bool):
    """Swap the TSP prefill's SDPA call for the estimator's flash-equivalent kernel."""
    if not enabled:
        yield
        return
    import megatron_tsp.core.layers.prefill_attention as inf_attn
    from megatron_tsp.core.layers import kernels

    def flash(q, k_nat, v_nat, blocks, offset, layout):
        """Each causal block's queries against the cached prefix plus keys up to the block's
        end, bottom-right aligned, through the layers' kernel interface (forward only)."""
        kernel = kernels.select_kernel(q.device, q.dtype, q.shape[-1], q.shape[2] != k_nat.shape[2])
        out = torch.empty(
            q.shape[0], q.shape[1], q.shape[2] * q.shape[3], dtype=q.dtype, device=q.device
        )
        heads = lambda t: t.permute(1, 2, 0, 3)  # noqa: E731
        for block in blocks:
            kv_len = offset + block.key_len
            rows = (block.query_start, block.query_len)
            o, _ = kernel.forward(
                heads(q.narrow(0, *rows)),
                heads(k_nat.narrow(0, 0, kv_len)),
                heads(v_nat.narrow(0, 0, kv_len)),
                kernels.BOTTOM_RIGHT,
                layout.softmax_scale,
            )
            out.narrow(0, *rows).copy_(kernels.chunk_rows(o))
            del o
        return out

    saved = inf_attn.chunk_attention
    inf_attn.chunk_attention = flash
    try:
        yield
    finally:
        inf_attn.chunk_attention = saved


def prefill_peak(
    scheme: str, size: int, seq: int, model=None, batch: int = 1, dtype: str = "bf16"
) -> dict:
    """Peak bytes of one rank prefilling ``seq`` tokens (fake tensors); see the module docstring.

    Returns ``{"peak": bytes, "breakdown": {category: bytes}, "kv_cache": bytes, "params": ...}``.
    """
    from megatron.core.inference.contexts import StaticInferenceContext
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from torch._subclasses.fake_tensor import FakeTensorMode

    from megatron_tsp.core.layout import TSPLayout
    from megatron_tsp.inference.engine import prefill_slice
    from megatron_tsp.megatron_lm.cpu_support import enable_cpu_support
    from megatron_tsp.megatron_lm.fake_world import init_fake_world
    from megatron_tsp.tools.estimator import fake_run as fr

    cfg = _run_config(scheme, size, seq, model or load_model("7b"), batch, dtype, True)
    cfg.validate()
    enable_cpu_support()
    init_fake_world(cfg.world_size)
    fr.init_parallel(cfg)
    config = fr.transformer_config(cfg)
    model_parallel_cuda_manual_seed(1234)
    shape = cfg.model
    head_dim = shape.hidden // shape.heads
    cache_groups = shape.groups if scheme == "cp" else shape.groups // size
    cache_tokens = seq // size if scheme == "cp" else seq
    element = 2 if dtype == "bf16" else 4
    kv_bytes = 2 * shape.num_layers * cache_tokens * batch * cache_groups * head_dim * element
    with FakeTensorMode(allow_non_fake_inputs=True):
        gpt = fr.build_model(cfg, config).eval()
        params = sum(p.numel() for p in gpt.parameters()) * element
        tracker = fr.lean_mem_tracker()
        tracker.track_external(gpt)
        local = seq // size if scheme == "cp" else seq
        tokens = torch.randint(0, shape.vocab, (batch, local))
        if scheme == "cp":
            from megatron.core import parallel_state as mpu

            cp_layout = TSPLayout(size, seq, mpu.get_context_parallel_rank())
            positions = cp_layout.positions()
        else:
            positions = torch.arange(seq)
        positions = positions.unsqueeze(0).expand(batch, -1)
        with (
            torch.no_grad(),
            fr.no_rng_fork(True),
            fr.cpu_cp_rope(),
            _flash_prefill_attention(scheme == "tsp"),
            tracker,
        ):
            table = gpt.rotary_pos_emb(seq)
            if scheme == "cp":
                # a CP rank caches K/V of all heads for its own S/D tokens, allocated up front
                params_dtype = config.params_dtype
                cache = [
                    torch.empty(cache_tokens, batch, cache_groups, head_dim, dtype=params_dtype)
                    for _ in range(2 * shape.num_layers)
                ]
                assert len(cache) == 2 * shape.num_layers  # held (measured) through the decoder
                hidden = gpt.embedding(input_ids=tokens, position_ids=positions)
                hidden = gpt.decoder(
                    hidden_states=hidden, attention_mask=None, rotary_pos_emb=table
                )
            else:
                context = StaticInferenceContext(batch, seq)
                if scheme == "tsp":
                    hidden = prefill_slice(gpt, tokens, positions, context, table, size)
                else:
                    hidden = gpt.embedding(input_ids=tokens, position_ids=positions)
                    hidden = gpt.decoder(
                        hidden_states=hidden,
                        attention_mask=None,
                        inference_context=context,
                        rotary_pos_emb=table,
                    )
            # tied embeddings: the output layer holds no weight of its own
            weight = (
                gpt.shared_embedding_or_output_weight()
                if gpt.share_embeddings_and_output_weights
                else None
            )
            logits, _ = gpt.output_layer(hidden[-1:], weight=weight)
            del hidden, logits
        snap = next(iter(tracker.get_tracker_snapshot("peak").values()), {})
    breakdown = {str(k.value if hasattr(k, "value") else k): int(v) for k, v in snap.items()}
    peak = breakdown.pop("Total", sum(breakdown.values()))
    return {
        "scheme": scheme,
        "size": size,
        "seq": seq,
        "batch": batch,
        "peak": peak,
        "breakdown": breakdown,
        "kv_cache": kv_bytes,
        "params": params,
    }


def prefill_peak_isolated(
    scheme: str,
    size: int,
    seq: int,
    model=None,
    batch: int = 1,
    dtype: str = "bf16",
    timeout: float = 3600,
) -> dict:
    """``prefill_peak`` in a fresh process (no module caches shared between measurements)."""
    payload = json.dumps(
        dict(
            scheme=scheme,
            size=size,
            seq=seq,
            batch=batch,
            dtype=dtype,
            model=(model or load_model("7b")).to_json(),
        )
    )
    code = (
        "import json, sys, warnings; warnings.filterwarnings('ignore'); "
        "from megatron_tsp.core.model_shape import ModelShape; "
        "from megatron_tsp.tools.estimator import inference_memory as m; "
        "a = json.loads(sys.stdin.read()); "
        "a['model'] = ModelShape.from_json(a['model']); "
        "print('@@RESULT@@' + json.dumps(m.prefill_peak(**a)))"
    )
    from megatron_tsp.tools.estimator.fake_run import run_in_fresh_process

    dynamo = {"TORCHDYNAMO_DISABLE": os.environ.get("TORCHDYNAMO_DISABLE", "1")}
    return run_in_fresh_process(code, payload, timeout, dynamo)


LABELS = {"tsp": "TSP prefill D={d}", "tp": "TP={d} prefill", "cp": "CP={d} prefill"}


def format_rows(rows, units: str = "GiB") -> str:
    div = 2**30 if units == "GiB" else 1e9
    head = (
        f"{'prefill':<18}{'tokens':>10}{'params':>9}{'KV cache':>10}{'activ+temp':>12}"
        f"{'peak':>9}  ({units}, one rank)"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        b = r["breakdown"]
        other = r["peak"] - b.get("Parameter", 0) - r["kv_cache"]
        lines.append(
            f"{LABELS[r['scheme']].format(d=r['size']):<18}{r['seq']:>10}"
            f"{b.get('Parameter', 0) / div:>9.2f}{r['kv_cache'] / div:>10.2f}"
            f"{other / div:>12.2f}{r['peak'] / div:>9.2f}"
        )
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = ToolParser(prog="megatron-tsp prefill-memory", description=__doc__.splitlines()[0])
    p.add_argument(
        "--model",
        default="7b",
        help="model name (megatron_tsp/models: 7b, small, tiny, ...) or a .json",
    )
    p.add_argument("--size", type=positive_int, default=8, help="GPUs: D for TSP, TP size, CP size")
    p.add_argument(
        "--seqs", type=positive_int_list, default="131072,524288,1048576", help="prompt lengths"
    )
    p.add_argument("--schemes", default="tsp,tp,cp")
    p.add_argument("--batch", type=positive_int, default=1)
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--units", choices=["GiB", "GB"], default="GiB")
    p.add_argument("--json", help="write the rows to this file")
    args = p.parse_args(argv)
    try:
        model = load_model(args.model)
    except ValueError as exc:
        p.error(f"--model: {exc}")
    rows = []
    schemes = [s for s in args.schemes.split(",") if s]
    bad = [s for s in schemes if s not in SCHEMES]
    if bad:
        p.error(f"--schemes: {bad[0]!r} is not one of {SCHEMES}")
    print(format_rows([], args.units), flush=True)  # the header once, then a row per run
    todo = [(seq, scheme) for seq in args.seqs for scheme in schemes]
    for i, (seq, scheme) in enumerate(todo, 1):
        print(
            f"megatron-tsp prefill-memory: [{i}/{len(todo)}] {scheme} S={seq} ...",
            file=sys.stderr,
            flush=True,
        )
        rows.append(prefill_peak_isolated(scheme, args.size, seq, model, args.batch, args.dtype))
        print(format_rows(rows[-1:], args.units).splitlines()[-1], flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
