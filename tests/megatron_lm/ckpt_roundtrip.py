"""Run ``checks.check_dist_checkpoint_interop`` on 2 gloo ranks in non-daemon processes.

Megatron's torch_dist checkpoint writer starts a multiprocessing Manager, which daemon processes
(the shared test pool's ranks) may not do. Usage: ``python ckpt_roundtrip.py OUT_DIR SEED``;
``python ckpt_roundtrip.py OUT_DIR SEED WORLD`` runs WORLD ranks (D = WORLD); writes
``OUT_DIR/results.json`` ({style: [one result per rank]}).
"""

import json
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STYLES = ("gpt2", "llama", "llama-mqa")  # llama-mqa: one K/V head, fewer than D


def _worker(rank, world, port, out_dir, seed):
    sys.path.insert(0, REPO)
    from tests.harness import init_gloo_rank

    init_gloo_rank(rank, world, port, timeout_s=120)
    import torch.distributed as dist

    from tests.megatron_lm import checks

    results = {}
    for style in STYLES:
        results[style] = checks.check_dist_checkpoint_interop(
            os.path.join(out_dir, "ckpt"), seed, style
        )
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(results, f)
    dist.barrier()
    dist.destroy_process_group()


def main(out_dir, seed, world=2):
    import torch.multiprocessing as mp

    sys.path.insert(0, REPO)
    from megatron_tsp.megatron_lm.cpu_runner import free_port

    mp.spawn(_worker, args=(world, free_port(), out_dir, seed), nprocs=world, join=True)
    merged = {
        s: [json.load(open(os.path.join(out_dir, f"rank{r}.json")))[s] for r in range(world)]
        for s in STYLES
    }
    with open(os.path.join(out_dir, "results.json"), "w") as f:
        json.dump(merged, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), *(int(a) for a in sys.argv[3:4]))
