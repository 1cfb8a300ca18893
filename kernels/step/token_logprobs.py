"""Per-token log-probabilities of the lm_head, chunked over the vocabulary: the (N, V) logits
are never whole in memory, in the forward or the backward (issue #47, the Dr. GRPO step's
log-probs and update).

Counterparts: Liger's ``LigerFusedLinearCrossEntropy`` / ``LigerFusedLinearGRPOLoss`` (chunked
over tokens, a chunk's logits whole) and TRL's ``selective_log_softmax`` (whole logits, then a
gather). Here the chunks run over the vocabulary, as the lm_head's rows:

  forward   for each chunk c of ``chunk`` rows of W: logits_c = h W_cᵀ (cuBLAS, in h's dtype, as
            the model's lm_head gives them); ``_fold_chunk_kernel`` (one program a token) folds
            them into the token's running max and sum of exp, and picks its target's logit when
            the target lies in c. log p = logit_t − (max + log sum).
  backward  for each chunk: logits_c again; ``_dlogits_chunk_kernel`` overwrites them with
            dlogits = g · (onehot(t) − exp(logit − lse)); then dh += dlogits W_c (fp32 sum over
            the chunks) and dW_c = dlogitsᵀ h (each row of W once, no sum).

The work is the three GEMMs of a linear layer plus one recomputed forward GEMM; the extra memory
is one chunk's (N, chunk) logits and an (N, H) fp32 dh. Inputs are checked before any launch.
"""
import torch
import triton
import triton.language as tl

from ws_lab.check import require_device, require_tensors

BLOCK_V = 1024  # logits a program step reads: one row of the chunk at a time
DEFAULT_CHUNK = 16384  # vocabulary rows a chunk: (16384 tokens × 16384) bf16 logits = 512 MB


@triton.jit
def _fold_chunk_kernel(Logits, Targets, RowMax, RowSum, TargetLogit, n_cols, col0, stride_l,
                       BLOCK: tl.constexpr):
    """Token ``row``: its running (max, Σ exp(logit − max)) over the chunk's ``n_cols`` logits
    (vocabulary ids col0 …), and its target's logit if the target is among them."""
    row = tl.program_id(0)
    target = tl.load(Targets + row)
    m = tl.load(RowMax + row)
    s = tl.load(RowSum + row)
    picked = tl.load(TargetLogit + row)
    base = Logits + row.to(tl.int64) * stride_l
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        ok = cols < n_cols
        x = tl.load(base + cols, mask=ok, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        s = s * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        m = m_new
        # past n_cols a column is the next chunk's id: only loaded columns may match
        picked += tl.sum(tl.where(ok & (cols + col0 == target), x, 0.0), axis=0)
    tl.store(RowMax + row, m)
    tl.store(RowSum + row, s)
    tl.store(TargetLogit + row, picked)


@triton.jit
def _dlogits_chunk_kernel(Logits, Targets, Lse, Grad, n_cols, col0, stride_l,
                          BLOCK: tl.constexpr):
    """Token ``row``'s chunk of logits, overwritten with d(log p_t)/d logits · g =
    g · (onehot(t) − softmax)."""
    row = tl.program_id(0)
    target = tl.load(Targets + row)
    lse = tl.load(Lse + row)
    g = tl.load(Grad + row)
    base = Logits + row.to(tl.int64) * stride_l
    for start in range(0, n_cols, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        ok = cols < n_cols
        x = tl.load(base + cols, mask=ok, other=0.0).to(tl.float32)
        d = g * (tl.where(cols + col0 == target, 1.0, 0.0) - tl.exp(x - lse))
        tl.store(base + cols, d.to(Logits.dtype.element_ty), mask=ok)


def _validate(hidden, weight, targets, chunk):
    require_tensors("token_logprobs", hidden=hidden, weight=weight, targets=targets)
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"token_logprobs: hidden (N, H) and weight (V, H) must share H, got "
                         f"{tuple(hidden.shape)} and {tuple(weight.shape)}")
    if targets.shape != hidden.shape[:1] or targets.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"token_logprobs: targets must be int32 / int64 of shape "
                         f"({hidden.shape[0]},), got {targets.dtype} {tuple(targets.shape)}")
    if hidden.dtype != weight.dtype or hidden.dtype not in (torch.float16, torch.bfloat16,
                                                            torch.float32):
        raise TypeError(f"token_logprobs: hidden and weight must share a dtype of fp16 / bf16 / "
                        f"fp32, got {hidden.dtype} and {weight.dtype}")
    if len({hidden.device, weight.device, targets.device}) != 1:
        raise ValueError("token_logprobs: hidden, weight and targets must be on one device")
    if not isinstance(chunk, int) or chunk < 1:
        raise ValueError(f"token_logprobs: chunk must be a positive int, got {chunk!r}")
    require_device(hidden.device, "triton")
    if targets.numel() and bool(((targets < 0) | (targets >= weight.shape[0])).any()):
        raise ValueError(f"token_logprobs: targets must lie in [0, {weight.shape[0]})")


def _chunks(weight, chunk):
    for col0 in range(0, weight.shape[0], chunk):
        yield col0, weight[col0:col0 + chunk]


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk):
        n = hidden.shape[0]
        row_max = torch.full((n,), float("-inf"), dtype=torch.float32, device=hidden.device)
        row_sum = torch.zeros(n, dtype=torch.float32, device=hidden.device)
        picked = torch.zeros(n, dtype=torch.float32, device=hidden.device)
        for col0, w in _chunks(weight, chunk):
            logits = hidden @ w.t()
            _fold_chunk_kernel[(n,)](logits, targets, row_max, row_sum, picked, w.shape[0],
                                     col0, logits.stride(0), BLOCK=BLOCK_V)
        lse = row_max + torch.log(row_sum)
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.chunk = chunk
        return picked - lse

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, targets, lse = ctx.saved_tensors
        grad = grad.float().contiguous()
        d_hidden = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
        d_weight = torch.empty_like(weight)
        for col0, w in _chunks(weight, ctx.chunk):
            dlogits = hidden @ w.t()
            _dlogits_chunk_kernel[(hidden.shape[0],)](dlogits, targets, lse, grad, w.shape[0],
                                                      col0, dlogits.stride(0), BLOCK=BLOCK_V)
            d_hidden += (dlogits @ w).float()
            torch.mm(dlogits.t(), hidden, out=d_weight[col0:col0 + w.shape[0]])
        return d_hidden.to(hidden.dtype), d_weight, None, None


def token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *,
                   chunk: int = DEFAULT_CHUNK) -> torch.Tensor:
    """log softmax(hidden Wᵀ)[n, targets[n]] for hidden (N, H), weight (V, H) (the lm_head's),
    targets (N,) in [0, V): (N,) fp32, differentiable in hidden and weight, the vocabulary
    taken ``chunk`` rows at a time. Validates its inputs first (the targets' range with one
    device sync)."""
    _validate(hidden, weight, targets, chunk)
    hidden, weight, targets = hidden.contiguous(), weight.contiguous(), targets.contiguous()
    return _TokenLogprobs.apply(hidden, weight, targets, chunk)
