"""FSDP x CP for the memory tool (``megatron-tsp memory --scheme fsdp_cp``): ZeRO-3 over the
whole sequence group, DP = 1 inside it (the planner's ``fsdp_cp``).

megatron-core's ``GPTModel`` with TP = 1 and CP = N (Megatron's zigzag split, the CP attention
stand-in of ``fake_run``: K/V all-gathered over the CP group, ``--cp-comm-type all_gather``) is
sharded with torch FSDP2 ``fully_shard`` over the same N ranks: every transformer layer its own
FSDP unit, the root (embedding, final norm, output layer) one more. Each rank holds 1/N of every
parameter in fp32 (the master weights: FSDP2 keeps the sharded parameters in their own dtype) and
Adam's m and v for that shard.

Communication, per FSDP unit and step (FSDP2's own collectives, on the CP group):

* forward: all-gather the unit's bf16 weights (``MixedPrecisionPolicy.param_dtype``; the fp32
  shard is cast to bf16 before the gather), freed again after the unit's forward
  (``reshard_after_forward=True``; the root keeps its weights gathered into the backward);
* backward: all-gather them again, then reduce-scatter the unit's bf16 weight gradient
  (``reduce_dtype`` = the model dtype, as Megatron-FSDP's default ``grad_reduce_in_fp32=False``);
  the reduced shard is cast to fp32 (the parameter dtype) and becomes the shard's ``.grad``.

Why FSDP2 and not Megatron-FSDP: FSDP2 runs here under ``FakeTensorMode`` with the ``fake``
process group and on CPU tensors as it is (its collectives are plain ``all_gather_into_tensor``
/ ``reduce_scatter_tensor`` calls); Megatron-FSDP's buffers and streams are CUDA-only.
"""

from __future__ import annotations

from typing import List

import torch


def shard_model(model: torch.nn.Module, cfg) -> torch.nn.Module:
    """``fully_shard`` every transformer layer of ``model`` and then the root over this rank's CP
    group (a CPU ``DeviceMesh`` over it), bf16 compute and gradient reduction (fp32 compute and
    reduction for ``cfg.dtype == "fp32"``). The model must be built with fp32 parameters."""
    from megatron.core import parallel_state as mpu
    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    group = mpu.get_context_parallel_group()
    # the mesh's rank table is metadata (DeviceMesh reads it with .tolist()): a real tensor,
    # built outside FakeTensorMode
    with unset_fake_temporarily():
        mesh = DeviceMesh.from_group(group, "cpu")
    dtype = torch.bfloat16 if cfg.dtype == "bf16" else torch.float32
    policy = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=dtype)
    for layer in model.decoder.layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=True, mp_policy=policy)
    fully_shard(model, mesh=mesh, reshard_after_forward=True, mp_policy=policy)
    return model


class ShardAdam:
    """Fused Adam over the FSDP2 shards (fp32 parameters = the master weights, fp32 ``.grad``
    shards from FSDP2's reduce-scatter), m and v allocated before the measured step (steady
    state). It steps the shards' local tensors in place, as a fused multi-tensor Adam does on
    GPU (torch's Adam on the DTensors themselves falls back to per-tensor code that reads the
    step count with ``.item()``, which a fake tensor cannot answer). No communication: the next
    forward's all-gather brings the updated weights."""

    def __init__(self, model: torch.nn.Module, lr: float = 1e-4):
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.shards = [_local(p) for p in self.params]
        self.optimizer = torch.optim.Adam(self.shards, lr=lr, fused=True)
        for p in self.shards:
            self.optimizer.state[p] = {
                "step": torch.zeros((), dtype=torch.float32),
                "exp_avg": torch.zeros_like(p),
                "exp_avg_sq": torch.zeros_like(p),
            }

    def tensors(self) -> List[torch.Tensor]:
        out = []
        for st in self.optimizer.state.values():
            out += [t for t in st.values() if isinstance(t, torch.Tensor)]
        return out

    def zero_grad(self) -> None:
        # steady state: the previous step's gradient shards were freed after its update
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def step(self) -> None:
        for p, shard in zip(self.params, self.shards):
            shard.grad = None if p.grad is None else _local(p.grad)
        self.optimizer.step()
        for shard in self.shards:
            shard.grad = None


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (the tensor itself otherwise)."""
    return getattr(t, "_local_tensor", t)
