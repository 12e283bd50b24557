"""TSP prefill + Megatron TP=D decode (megatron_tsp.inference)."""

import pytest
import torch

from tests import checks_inference


@pytest.mark.parametrize("style", ["gpt2", "llama"])
@pytest.mark.parametrize("d", [2, 4])
def test_generation_matches_single_process_fp64(pool4, seed, d, style):
    """Greedy tokens identical to a single-process model; KV cache after TSP prefill equals TP
    prefill's tensor for tensor; last-token logits equal TP's and the single model's; two-chunk
    prefill equals one-shot; mixed lengths; prompts shorter than 2D (TP fallback)."""
    results = pool4.run(checks_inference.check_generation, d, seed, style)
    worst = {k: max(r[k] for r in results) for k in results[0]}
    assert max(worst.values()) <= 1e-12, worst


@pytest.mark.parametrize("d,groups", [(4, 2), (4, 1), (2, 1)])
def test_generation_fewer_kv_heads_than_d(pool4, seed, d, groups):
    """num_query_groups < D (megatron-core's TP layout, K/V heads shared by D / groups ranks):
    the same checks; the TSP prefill's cache equals Megatron TP=D prefill's on every rank of a
    group, so TP decode continues from it."""
    results = pool4.run(checks_inference.check_generation, d, seed, "llama", groups=groups)
    worst = {k: max(r[k] for r in results) for k in results[0]}
    assert max(worst.values()) <= 1e-12, worst


@pytest.mark.parametrize("d,groups,kv_channels", [(2, 4, 8), (4, 2, 2)])
def test_generation_kv_channels(pool4, seed, d, groups, kv_channels):
    """A head dimension other than hidden / heads = 4 (``kv_channels``; Llama style, GQA, the
    second case with fewer K/V heads than D): the same checks, TSP prefill's cache equal to
    Megatron TP=D prefill's and TP decode continuing from it."""
    results = pool4.run(
        checks_inference.check_generation, d, seed, "llama", groups=groups, kv_channels=kv_channels
    )
    worst = {k: max(r[k] for r in results) for k in results[0]}
    assert max(worst.values()) <= 1e-12, worst


def test_sampling_stop_tokens_and_errors(pool4, seed):
    results = pool4.run(checks_inference.check_sampling_and_errors, 2, seed)
    assert all(r["sampled"] == results[0]["sampled"] for r in results), "ranks disagree"
    for needle, message in results[0]["errors"].items():
        assert needle in message


def test_filter_logits_top_k_top_p(seed):
    from megatron_tsp.inference.sampling import filter_logits

    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(3, 50, generator=g, dtype=torch.float64)
    kept = torch.isfinite(filter_logits(logits, 5, 1.0))
    assert (kept.sum(-1) == 5).all()
    assert torch.equal(kept, torch.zeros_like(kept).scatter(-1, logits.topk(5).indices, True))
    probs = torch.softmax(logits, -1)
    nucleus = torch.isfinite(filter_logits(logits, 0, 0.5))
    for row in range(3):
        p = probs[row][nucleus[row]]
        assert p.sum() >= 0.5, f"seed {seed}"
        assert p.sum() - p.min() < 0.5, f"seed {seed}: nucleus is not minimal"


def _run_cli(*args, timeout=600):
    import os
    import subprocess
    import sys

    from tests.harness import REPO

    env = dict(os.environ, PYTHONPATH=REPO, TORCHDYNAMO_DISABLE="1", OMP_NUM_THREADS="1")
    return subprocess.run(
        [sys.executable, "-m", "megatron_tsp.tools.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=REPO,
    )


def test_generate_cli_save_and_load(tmp_path):
    """`megatron-tsp generate` on gloo ranks: a batch of two text prompts of different lengths,
    prefill and decode throughput printed, TP=D prefill gives the same tokens; the model saved as
    a Megatron-LM torch_dist checkpoint under TP=2 loads under D=1 (resharded by megatron-core)
    and generates the same tokens (fp64)."""
    ckpt = str(tmp_path / "ckpt")
    common = (
        "--train-steps",
        "0",
        "--max-new-tokens",
        "5",
        "--dtype",
        "float64",
        "--prompt",
        "the cat sees",
        "--prompt",
        "a dog",
    )
    proc = _run_cli("generate", "--tsp", "2", "--check-tp", "--save", ckpt, *common)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    out = proc.stdout
    assert "prefill=tsp" in out and "tokens/s | decode:" in out, out
    assert "TP=D prefill check: tokens identical" in out, out
    loaded = _run_cli("generate", "--tsp", "1", "--load", ckpt, *common)
    assert loaded.returncode == 0, loaded.stdout + loaded.stderr[-3000:]

    def generations(text):
        return [line for line in text.splitlines() if line.startswith(("[0]", "[1]"))]

    assert len(generations(out)) == 2 and generations(out) == generations(loaded.stdout), (
        out,
        loaded.stdout,
    )


def test_prefill_memory_tool(tmp_path):
    """Fake-tensor prefill peaks (tiny model, D=2): KV cache as the formula says, TSP below TP
    and CP, and every peak holds at least the weights and the cache."""
    import json

    path = tmp_path / "rows.json"
    proc = _run_cli(
        "prefill-memory", "--model", "tiny", "--size", "2", "--seqs", "2048", "--json", str(path)
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    rows = {r["scheme"]: r for r in json.loads(path.read_text())}
    # megatron_tsp/models/tiny.json
    layers, hidden, heads, seq, d, bf16 = 2, 64, 4, 2048, 2, 2
    head_dim = hidden // heads
    assert rows["tsp"]["kv_cache"] == 2 * layers * seq * (heads // d) * head_dim * bf16
    assert rows["cp"]["kv_cache"] == 2 * layers * (seq // d) * heads * head_dim * bf16
    for r in rows.values():
        assert r["peak"] >= r["breakdown"]["Parameter"] + r["kv_cache"], r
    assert rows["tsp"]["peak"] < rows["tp"]["peak"], rows
    assert rows["tsp"]["peak"] < rows["cp"]["peak"], rows


@pytest.mark.parametrize("style,groups", [("gpt2", None), ("llama", 2)])
def test_generation_tsp_x_cp(pool4, seed, style, groups):
    """TSP2 x CP2 prefill over 4 ranks, TP=2 decode on CP rank 0: greedy tokens equal the
    single-process model's on every rank; CP rank 0's cache equals a TP=2 prefill's."""
    results = pool4.run(checks_inference.check_generation_cp, 2, 2, seed, style, groups=groups)
    worst = {k: max(r.get(k, 0.0) for r in results) for k in results[0]}
    assert max(worst.values()) <= 1e-12, worst
