"""The forward's measured dispatch rules, in one place (FA3's ``hopper/heuristics.h``): each
says in a line why, with the ``notes/`` anchor of its measurement. What a kernel can run at all
stays with the kernel (``supports``, ``Config``'s own checks).
"""
from ws_lab.kernels.fwd.tile_scheduler import kv_exceed_half_l2


def fp8_design(batch, seq_len, kv_heads, head_dim, return_lse: bool, l2_bytes: int) -> str:
    """``fp8.attention_fp8``'s design when the call asks for ``"auto"``:
    - the lse: "pipelined", the one design that writes it;
    - e4m3 K / V beyond half of L2 (the persistent walk pairs CTAs or groups Q tiles there):
      "coop-overlap-rs-desc", 1.007 × FA3 FP8 on train8b-8k against the persistent one's
      0.986 (notes/fp8.md, "Session 61");
    - else "coop-overlap-rs-persistent-desc": 0.994 / 0.952 / 0.938 × FA3 FP8 on train8b-4k /
      llama8b-8k / llama8b-4k against rs-desc's 0.983 / 0.935 / 0.910 (notes/fp8.md,
      "Session 61", "Session 62")."""
    if return_lse:
        return "pipelined"
    if kv_exceed_half_l2(batch, seq_len, kv_heads, head_dim, head_dim, l2_bytes, elem_bytes=1):
        return "coop-overlap-rs-desc"
    return "coop-overlap-rs-persistent-desc"


def fp8_pingpong(design: str, causal: bool) -> bool:
    """Pingpong (FA3's scheduler barrier, which FA3 keeps for FP8 at D ≥ 128) on an FP8
    coop-overlap design: off for causal calls of "coop-overlap-rs-persistent-desc", 1.021 /
    1.004 × pingpong on llama8b-4k / -8k (0.996 on the full train8b-4k: on there;
    notes/fp8.md, "Session 68"); on elsewhere, where off was never timed."""
    return not (causal and design == "coop-overlap-rs-persistent-desc")
