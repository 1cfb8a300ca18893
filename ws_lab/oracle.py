"""Float64 attention references. Every kernel family of the lab is checked against this module.

Layout BSHD: q (B, S, Hq, D), k (B, S, Hkv, D), v (B, S, Hkv, Dv) -> out (B, S, Hq, Dv).
Query head h reads KV head h // (Hq // Hkv).
"""
from __future__ import annotations

import itertools
import math

import torch

from ws_lab.rope import apply_rope

# float64 score elements materialized at once (2^27 = 1 GiB).
_SCORE_ELEMS = 1 << 27


def attention_ref(q, k, v, causal=False, softmax_scale=None):
    """Returns (out, lse): out (B, S, Hq, Dv) float64; lse (B, Hq, S) float64, natural log.

    Computed a few heads at a time so that S = 16k fits in memory.
    """
    batch, seq_q, heads, head_dim = q.shape
    kv_heads, seq_k = k.shape[2], k.shape[1]
    if heads % kv_heads:
        raise ValueError(f"Hq={heads} is not a multiple of Hkv={kv_heads}")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    group = heads // kv_heads
    future = torch.ones(seq_q, seq_k, dtype=torch.bool, device=q.device).triu(1) if causal else None
    out = torch.empty(batch, heads, seq_q, v.shape[3], dtype=torch.float64, device=q.device)
    lse = torch.empty(batch, heads, seq_q, dtype=torch.float64, device=q.device)
    chunk = max(1, _SCORE_ELEMS // (seq_q * seq_k))
    for b in range(batch):
        for h0 in range(0, heads, chunk):
            hs = torch.arange(h0, min(h0 + chunk, heads), device=q.device)
            qd = q[b, :, hs].to(torch.float64).transpose(0, 1)             # h S D
            kd = k[b, :, hs // group].to(torch.float64).transpose(0, 1)    # h S D
            vd = v[b, :, hs // group].to(torch.float64).transpose(0, 1)    # h S Dv
            scores = torch.matmul(qd, kd.transpose(-1, -2)) * scale
            if causal:
                scores.masked_fill_(future, float("-inf"))
            lse[b, hs] = torch.logsumexp(scores, dim=-1)
            out[b, hs] = torch.matmul(torch.exp(scores - lse[b, hs].unsqueeze(-1)), vd)
    return out.transpose(1, 2), lse


def attention_bwd_ref(q, k, v, dout, causal=False, softmax_scale=None):
    """(dq, dk, dv) float64, shaped as q, k, v: autograd through ``attention_ref`` in float64
    for the upstream gradient ``dout`` (B, S, Hq, Dv); dk / dv summed over each query group.
    One (sequence, KV head) at a time, so a step keeps group·S² float64 scores a few times
    (S = 8k at group 4: ~2 GB each) rather than every head's."""
    batch, heads, kv_heads = q.shape[0], q.shape[2], k.shape[2]
    if heads % kv_heads:
        raise ValueError(f"Hq={heads} is not a multiple of Hkv={kv_heads}")
    group = heads // kv_heads
    grads = [torch.empty(t.shape, dtype=torch.float64, device=t.device) for t in (q, k, v)]
    for b, j in itertools.product(range(batch), range(kv_heads)):
        rows = (slice(b, b + 1), slice(None), slice(j * group, (j + 1) * group))
        kv_rows = (slice(b, b + 1), slice(None), slice(j, j + 1))
        leaves = [t[where].detach().to(torch.float64).requires_grad_()
                  for t, where in ((q, rows), (k, kv_rows), (v, kv_rows))]
        out, _ = attention_ref(*leaves, causal=causal, softmax_scale=softmax_scale)
        parts = torch.autograd.grad(out, leaves, dout[rows].to(torch.float64))
        for grad, where, part in zip(grads, (rows, kv_rows, kv_rows), parts):
            grad[where] = part
    return tuple(grads)


def token_logprobs_ref(hidden, weight, targets):
    """log softmax(hidden Wᵀ)[n, targets[n]] in float64: hidden (N, H), weight (V, H), targets
    (N,); differentiable in float64 leaves."""
    logits = hidden.to(torch.float64) @ weight.to(torch.float64).t()
    return torch.log_softmax(logits, dim=-1).gather(1, targets.long()[:, None])[:, 0]


def rel_l2(out, ref) -> float:
    """‖out − ref‖ / ‖ref‖ in float64; NaN anywhere in out gives NaN (which fails every check)."""
    out64, ref64 = out.to(torch.float64), ref.to(torch.float64)
    return (torch.linalg.vector_norm(out64 - ref64) / torch.linalg.vector_norm(ref64)).item()


def paged_attention_ref(q, k_cache, v_cache, block_table, context_lens, softmax_scale=None):
    """Decode attention over a paged KV cache, in float64.

    q (B, Hq, D); k_cache / v_cache (num_blocks, block_size, Hkv, D); block_table (B, max_blocks)
    int32; context_lens (B,) int32. Sequence b's token t lives in block block_table[b, t //
    block_size] at slot t % block_size. A length is clamped to [0, max_blocks · block_size]
    (the kernels' contract) and an empty sequence attends to nothing: zeros. A sequence whose
    context uses a block id outside [0, num_blocks) has no defined answer: NaN, as the kernels
    give. Returns (B, Hq, D) float64.
    """
    batch, heads, head_dim = q.shape
    block_size, kv_heads = k_cache.shape[1], k_cache.shape[2]
    if heads % kv_heads:
        raise ValueError(f"Hq={heads} is not a multiple of Hkv={kv_heads}")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    group = heads // kv_heads
    out = torch.empty(batch, heads, v_cache.shape[3], dtype=torch.float64, device=q.device)
    capacity = block_table.shape[1] * block_size
    for b in range(batch):
        n = min(max(int(context_lens[b]), 0), capacity)
        if n == 0:
            out[b] = 0.0
            continue
        tokens = torch.arange(n, device=q.device)
        blocks = block_table[b, tokens // block_size].long()
        slots = tokens % block_size
        if not _in_pool(blocks, k_cache.shape[0]):
            out[b] = float("nan")
            continue
        k = k_cache[blocks, slots].to(torch.float64).repeat_interleave(group, dim=1)  # n Hq D
        v = v_cache[blocks, slots].to(torch.float64).repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", q[b].to(torch.float64), k) * scale
        out[b] = torch.einsum("hn,nhd->hd", torch.softmax(scores, dim=-1), v)
    return out


def _in_pool(blocks, num_blocks) -> bool:
    return bool(((blocks >= 0) & (blocks < num_blocks)).all())


def rope_ref(x, cos, sin):
    """Rotate-half RoPE (HF Llama / Qwen2 ``apply_rotary_pos_emb``) in float64: x (..., D) with
    cos / sin broadcast to it."""
    return apply_rope(*(t.to(torch.float64) for t in (x, cos, sin)))


def fused_decode_ref(q, k_new, v_new, k_cache, v_cache, cos, sin, positions, softmax_scale=None,
                     block_table=None):
    """The unfused float64 reference of one fused decode step: RoPE on q and k_new at each
    sequence's position, the cache write (rotated k and v, cast to the cache dtype, at
    ``positions[b]``), then attention of q over tokens [0, positions[b]].

    Static caches (B, Hkv, Lmax, D), or paged ones (num_blocks, block_size, Hkv, D) with
    ``block_table``. A position outside [0, capacity) writes nothing and gives a NaN row; a
    block id outside the pool among tokens [0, position] gives a NaN row, and writes nothing
    if it is the written slot's (the kernels' contract). The caches are not modified. Returns (out (B, Hq, D) float64, the rotated k_new (B, Hkv, D)
    float64, the caches as the step leaves them)."""
    batch, heads, head_dim = q.shape
    paged = block_table is not None
    capacity = block_table.shape[1] * k_cache.shape[1] if paged else k_cache.shape[2]
    pos = positions.long()
    in_range = (pos >= 0) & (pos < capacity)
    at = torch.where(in_range, pos, 0)  # RoPE's row; a bad position's row is NaN anyway
    q_rot = rope_ref(q, cos[at][:, None], sin[at][:, None])
    k_rot = rope_ref(k_new, cos[at][:, None], sin[at][:, None])
    k_after, v_after = k_cache.clone(), v_cache.clone()
    # token rows of both layouts as [index tuple] -> (n, Hkv, D): (block, slot) or (b, token)
    k_rows, v_rows = (k_after, v_after) if paged else (k_after.transpose(1, 2),
                                                       v_after.transpose(1, 2))
    reads = {}
    for b in range(batch):
        if not in_range[b]:
            continue  # a NaN row; nothing written
        tokens = torch.arange(int(pos[b]) + 1, device=q.device)
        where = ((block_table[b, tokens // k_cache.shape[1]].long(), tokens % k_cache.shape[1])
                 if paged else (torch.full_like(tokens, b), tokens))
        last = tuple(w[-1] for w in where)
        if paged and not _in_pool(last[0], k_cache.shape[0]):
            continue
        k_rows[last], v_rows[last] = k_rot[b].to(k_cache.dtype), v_new[b]
        if not paged or _in_pool(where[0], k_cache.shape[0]):
            reads[b] = where
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
    group = heads // k_new.shape[1]
    out = torch.full((batch, heads, head_dim), float("nan"), dtype=torch.float64, device=q.device)
    for b, where in reads.items():
        k = k_rows[where].to(torch.float64).repeat_interleave(group, dim=1)  # n Hq D
        v = v_rows[where].to(torch.float64).repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,nhd->hn", q_rot[b], k) * scale
        out[b] = torch.einsum("hn,nhd->hd", torch.softmax(scores, dim=-1), v)
    return out, k_rot, (k_after, v_after)
