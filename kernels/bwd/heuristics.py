"""The backward's dispatch rules, in one place (FA3's ``hopper/heuristics.h``): each says in a
line why, with the ``notes/`` anchor of its measurement. What a kernel can run at all stays
with the kernel (``pipelined.supports``, ``Config``'s own checks).
"""


def main_kernel_steps(seq_len, group, causal, block_kv, block_q, head_splits):
    """(the longest CTA's steps, every CTA's steps) of ``pipelined.flash_bwd`` for one
    (batch, KV head): a CTA walks its group / head_splits query heads over the Q tiles that see
    its K/V tile."""
    n_qtiles = -(-seq_len // block_q)
    walk = [n_qtiles - (bx * block_kv // block_q if causal else 0)
            for bx in range(-(-seq_len // block_kv))]
    return group // head_splits * max(walk), group * sum(walk)


def block_q(head_dim) -> int:
    """The main kernel's Q rows a step (``pipelined.Config.block_q``): 128 at D ≤ 64, FA3's and
    FA-CuTe's hdim-64 tile (128 × 128; dK, dV and dQ 32 registers each, half the steps for the
    same GEMM work; the Qwen row 3 % faster than at 64); 64 above, where 128
    would not fit the registers (notes/bwd.md, "Session 36", "Session 64")."""
    return 128 if head_dim <= 64 else 64


def head_splits(batch, seq_len, kv_heads, group, causal, block_kv, block_q, sms) -> int:
    """The fewest splits of the query group (a divisor of it) for which no CTA walks longer
    than the SMs' mean share of all steps, else the most: with the group whole, Qwen2.5-0.5B's
    training shape (B 8, S 456, 14 / 2 heads) launched 64 CTAs of up to 56 steps on 132 SMs
    and ran at 0.66 × TileOPs' one-head-a-CTA kernel; split 7 ways, 0.98 × (notes/bwd.md,
    "Session 50", "Session 51"). ``pipelined.planned_config`` applies it, and
    ``attention_bwd`` plans by it unless given a config."""
    divisors = [s for s in range(1, group + 1) if group % s == 0]
    for s in divisors:
        longest, total = main_kernel_steps(seq_len, group, causal, block_kv, block_q, s)
        if longest * sms <= total * kv_heads * batch:
            return s
    return divisors[-1]


def kv_fill(kv_heads, n_kvtiles, causal, sms) -> int:
    """``tile_scheduler.grouped_kv_tile``'s group for ``ws``: causal, the most KV heads (a
    divisor of ``kv_heads``, so any batch fills whole groups) whose K/V tiles fit one wave of
    ``sms`` CTAs, so a wave reads their Q / dO and adds into their dQ rows only (TileOPs'
    rule); full, 1: a unit's CTAs already walk the same Q tiles together."""
    if not causal:
        return 1
    fits = [f for f in range(1, kv_heads + 1) if kv_heads % f == 0 and f * n_kvtiles <= sms]
    return max(fits, default=1)


def backend(ws_runs: bool, config_given: bool, deterministic: bool) -> str:
    """``attention_bwd``'s main kernel when the call names none: ``ws`` wherever it runs the
    call (D 128, S a multiple of 128) and no ``pipelined`` option is asked for; measured 1.01–
    1.04 × ``pipelined`` on the full 8B rows and 1.04–1.09 × on the causal ones (notes/bwd.md,
    "Session 53")."""
    return "ws" if ws_runs and not config_given and not deterministic else "pipelined"
