"""Flash-attention kernels with log-sum-exp, for TSP's zigzag causal attention.

A local zigzag chunk c (C queries at positions [cC, (c+1)C)) attends to keys [0, (c+1)C). That is
two blocks: keys [0, cC) with no mask, and the diagonal block [cC, (c+1)C) with an ordinary
(square) causal mask. Each block runs a flash kernel that also returns its log-sum-exp; the blocks
are merged exactly (``out = sum_i exp(lse_i - lse) out_i``, ``lse = logaddexp(lse_i)``), so no
C x S mask and no score matrix is ever built. The backward pass runs each block's flash backward
with the *merged* output and log-sum-exp (the same identity ring attention uses), so saving
``(out, lse)`` in the forward makes the attention forward recompute unnecessary.

Kernels: ``_scaled_dot_product_flash_attention_for_cpu`` on CPU (any float dtype; it also has a
fake-tensor kernel, so full-scale memory runs see flash behaviour), and
``_scaled_dot_product_flash_attention`` on CUDA (fp16 / bf16). ``supported(q)`` says whether a
tensor can use them; TSP attention falls back to recomputing a public-SDPA forward otherwise.
"""

from __future__ import annotations

from typing import List, Optional, Sequence, Tuple

import torch


def supported(t: torch.Tensor, head_dim: int, dropout_p: float) -> bool:
    if dropout_p > 0:
        return False
    if t.device.type == "cpu":
        return hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu")
    if t.device.type == "cuda":
        return t.dtype in (torch.float16, torch.bfloat16) and head_dim <= 256
    return False


def _fwd(q, k, v, causal: bool, scale: float):
    """One block: (out [b, h, s, d], lse [b, h, s] fp32, aux for the backward)."""
    if q.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, 0.0, causal, scale=scale)
        return out, lse, None
    res = torch.ops.aten._scaled_dot_product_flash_attention(
        q.contiguous(), k.contiguous(), v.contiguous(), 0.0, causal, False, scale=scale)
    return res[0], res[1], tuple(res[2:8])


def _bwd(dout, q, k, v, out, lse, causal: bool, scale: float, aux):
    if q.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout, q, k, v, out, lse, 0.0, causal, scale=scale)
    cum_q, cum_k, max_q, max_k, seed, offset = aux
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        dout.contiguous(), q.contiguous(), k.contiguous(), v.contiguous(), out.contiguous(), lse,
        cum_q, cum_k, max_q, max_k, 0.0, causal, seed, offset, scale=scale)


def _blocks(c: int, c_len: int) -> List[Tuple[int, int, bool]]:
    """Key ranges (start, end, causal) seen by zigzag chunk c."""
    blocks = [(0, c * c_len, False)] if c > 0 else []
    return blocks + [(c * c_len, (c + 1) * c_len, True)]


def _heads(t: torch.Tensor, rep: int) -> torch.Tensor:
    """[s, b, g, d] -> [b, g*rep, s, d] (each key/value head serves ``rep`` query heads)."""
    t = t.permute(1, 2, 0, 3)
    return t.repeat_interleave(rep, dim=1) if rep > 1 else t


def forward(q, k_nat, v_nat, chunks: Sequence[int], scale: float):
    """q [2C, b, np, d] (local chunks in order), k_nat/v_nat [S, b, ng, d] in natural order.

    Returns (out [2C, b, np*d], saved) where ``saved`` holds per-chunk (out, lse, aux) for
    ``backward``."""
    n_chunks = len(chunks)
    c_len = q.shape[0] // n_chunks
    rep = q.shape[2] // k_nat.shape[2]
    acc_dtype = torch.promote_types(q.dtype, torch.float32)  # merge in >= fp32
    outs, saved = [], []
    for i, c in enumerate(chunks):
        q_c = q[i * c_len:(i + 1) * c_len].permute(1, 2, 0, 3)
        out, lse, auxes = None, None, []
        for start, end, causal in _blocks(c, c_len):
            o, l, aux = _fwd(q_c, _heads(k_nat[start:end], rep), _heads(v_nat[start:end], rep),
                             causal, scale)
            auxes.append(aux)
            o = o.to(acc_dtype)
            if out is None:
                out, lse = o, l
            else:
                new = torch.logaddexp(lse, l)
                out = out * torch.exp(lse - new).unsqueeze(-1).to(acc_dtype) + o * torch.exp(
                    l - new).unsqueeze(-1).to(acc_dtype)
                lse = new
        out = out.to(q.dtype)
        saved.append((out, lse, auxes))
        outs.append(out.permute(2, 0, 1, 3).reshape(c_len, q.shape[1], -1))
    return torch.cat(outs, dim=0), saved


def backward(d_out, q, k_nat, v_nat, chunks: Sequence[int], scale: float, saved):
    """Gradients (dq [2C, b, np, d], dk_nat, dv_nat [S, b, ng, d]) from the saved forward."""
    n_chunks = len(chunks)
    c_len = q.shape[0] // n_chunks
    heads, groups, dim = q.shape[2], k_nat.shape[2], q.shape[3]
    rep = heads // groups
    dq = torch.empty_like(q)
    dk = torch.zeros_like(k_nat)
    dv = torch.zeros_like(v_nat)
    for i, c in enumerate(chunks):
        rows = slice(i * c_len, (i + 1) * c_len)
        q_c = q[rows].permute(1, 2, 0, 3)
        do_c = d_out[rows].view(c_len, q.shape[1], heads, dim).permute(1, 2, 0, 3)
        out, lse, auxes = saved[i]
        dq_c: Optional[torch.Tensor] = None
        for (start, end, causal), aux in zip(_blocks(c, c_len), auxes):
            gq, gk, gv = _bwd(do_c, q_c, _heads(k_nat[start:end], rep),
                              _heads(v_nat[start:end], rep), out, lse, causal, scale, aux)
            dq_c = gq if dq_c is None else dq_c + gq
            if rep > 1:  # sum the query heads that shared a key/value head
                gk = gk.unflatten(1, (groups, rep)).sum(2)
                gv = gv.unflatten(1, (groups, rep)).sum(2)
            dk[start:end] += gk.permute(2, 0, 1, 3)
            dv[start:end] += gv.permute(2, 0, 1, 3)
        dq[rows] = dq_c.permute(2, 0, 1, 3)
    return dq, dk, dv
