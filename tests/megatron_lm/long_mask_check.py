"""Rank-side script for test_long_sequence_mask.py: Megatron-LM's own data path for one
micro-batch, measured.

Run by ``cpu_runner.run_training`` (so through ``megatron_tsp.megatron_lm.launch``, hooks installed)
with pretrain_gpt.py's command line: Megatron's ``initialize_megatron`` parses and validates it (TSP
translation included), then pretrain_gpt's own dataset provider builds the mock dataset on TP rank 0
and pretrain_gpt's ``get_batch`` runs ``get_batch_on_this_tp_rank`` (broadcast) and the hooked
``get_batch_on_this_cp_rank`` (zigzag). Prints one ``LONG_MASK_RESULT {json}`` line per rank: peak
resident memory growth over the data path, the batch's shapes and, with
``--reset-attention-mask``, the documents the batch hook read.

The address space is capped at the current size + 3 GiB first, so a data path that builds an
S x S mask at 128k (17-68 GB) fails with an allocation error instead of exhausting the machine.
"""

import json
import os
import resource
import sys

import torch


def _vm_size_bytes():
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return None


def _rss_bytes():
    """Resident memory now (VmRSS): unlike the peak, it grows with anything still alive even when
    start-up already set a higher high-water mark."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _peak_rss_bytes():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def main():
    from megatron.training import get_args
    from megatron.training.initialize import initialize_megatron

    initialize_megatron()
    args = get_args()
    checkout = os.environ["MEGATRON_LM_PATH"]
    sys.path.insert(0, checkout)
    import pretrain_gpt  # after the launcher's install(): it imports the hooked function by name

    vm = _vm_size_bytes()
    if vm is not None:
        limit = vm + 3 * 2**30
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    before = _peak_rss_bytes()
    rss_before = _rss_bytes()
    from megatron.core import parallel_state as mpu

    iterator = None
    # every rank calls the provider (Megatron's dataset builder has a barrier); TP rank 0 builds
    train_ds, _, _ = pretrain_gpt.train_valid_test_datasets_provider([2, 0, 0])
    if mpu.get_tensor_model_parallel_rank() == 0:
        samples = [train_ds[i] for i in range(args.micro_batch_size)]
        iterator = iter([torch.utils.data.default_collate(samples)])
    batch = pretrain_gpt.get_batch(iterator)
    tokens, labels, loss_mask, attention_mask, position_ids = batch[:5]
    growth = _peak_rss_bytes() - before
    rss_growth = _rss_bytes() - rss_before
    from megatron_tsp.core.documents import as_documents

    documents = as_documents(attention_mask)  # --reset-attention-mask under TSP
    result = {
        "rank": torch.distributed.get_rank(),
        "attention_mask_type": None if attention_mask is None else type(attention_mask).__name__,
        "documents_per_sample": None if documents is None else [len(r) for r in documents.starts],
        "documents_seq_length": None if documents is None else documents.seq_length,
        # --reset-position-ids: one 0 per document (any order: the zigzag permutes them)
        "position_restarts": int((position_ids == 0).sum()),
        "seq_length": args.seq_length,
        "create_attention_mask_in_dataloader": bool(args.create_attention_mask_in_dataloader),
        "growth_bytes": growth,
        "rss_growth_bytes": rss_growth,
        "tokens_shape": list(tokens.shape),
        "attention_mask_shape": None if attention_mask is None else list(attention_mask.shape),
        "positions_head": position_ids[0, :4].tolist(),
    }
    print("LONG_MASK_RESULT " + json.dumps(result), flush=True)
    torch.distributed.barrier()


if __name__ == "__main__":
    main()
