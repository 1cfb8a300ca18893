"""The measured dispatch rules of the decode kernels, in one place (FA3's
``hopper/heuristics.h``): which backend and mode a call runs, each mode's launch config, how
many context segments. Each rule says in a line why, with the ``notes/`` anchor of its
measurement. Hard limits (what a kernel can run at all) stay with the kernel's ``supports``;
the CUDA kernels' own configs stay beside their ``.cu`` instantiations (``paged_cuda.CONFIGS``).
"""
import dataclasses
import math
from dataclasses import dataclass

import triton

from ws_lab.kernels.decode.triton_common import MERGE_ELEMS_PER_THREAD

# --- paged decode, the Triton modes ---


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


@dataclass(frozen=True)
class LaunchConfig:
    tile_n: int  # tokens per tile
    num_warps: int
    num_stages: int
    waves: int  # split_k: aim for this many waves of (B, Hkv, segment) programs
    # split_k: cap the segments so the scratch round trip (each query head's partial O, written
    # and read back: group · segments / context of the K/V bytes) stays within 1/scratch_div of
    # the K/V read; 0: no cap.
    scratch_div: int = 0
    # split_k: the last segment program of each (b, KV head) merges its heads (no reduce
    # launch) when group × segments ≤ merge_partials; else the reduce kernel.
    merge_partials: int = 0

    def __post_init__(self):
        """Refused here, before Triton sees it (a bad config is a Triton-internal assertion)."""
        fields = (self.tile_n, self.num_warps, self.num_stages, self.waves, self.scratch_div,
                  self.merge_partials)
        if any(isinstance(f, bool) or not isinstance(f, int) for f in fields):
            raise TypeError(f"LaunchConfig takes integers, got {fields}")
        if not (_pow2(self.tile_n) and self.tile_n >= 16 and _pow2(self.num_warps)
                and self.num_warps <= 32 and self.num_stages >= 1 and self.waves >= 1
                and self.scratch_div >= 0 and self.merge_partials >= 0):
            raise ValueError(f"LaunchConfig needs tile_n a power of two ≥ 16, num_warps a power of "
                             f"two ≤ 32, num_stages and waves ≥ 1, scratch_div and merge_partials "
                             f"≥ 0; got {fields}")

    @classmethod
    def parse(cls, text: str) -> "LaunchConfig":
        """'tile_n,num_warps,num_stages,waves[,scratch_div[,merge_partials]]' (the form
        bench/paged.py prints)."""
        return cls(*(int(x) for x in text.split(",")))

    def __str__(self):
        return (f"{self.tile_n},{self.num_warps},{self.num_stages},{self.waves},"
                f"{self.scratch_div},{self.merge_partials}")


# Per mode, from `python bench/paged.py --tune` on the H100 (notes/triton.md; split_k re-tuned
# in Session 16 on disjoint tables with programmatic dependent launch): split_k takes 3 stages
# and always the reduce kernel (merge_partials 0) — with PDL the reduce launches while the split
# programs drain, and it beat the in-kernel merge on llama3-8b B8 (28.9 vs 31.3 µs) at equal
# speed on llama70b B4 and MQA B16. gqa (B·Hkv ≥ SMs, one program per KV head, streaming at the
# HBM floor) keeps 128-token tiles on 8 warps, 3–7 % faster there than 64 on 4;
# ``launch_config`` deepens its pipeline and halves its warps where the grid is short.
DEFAULTS = {"v1": LaunchConfig(tile_n=128, num_warps=8, num_stages=2, waves=4),
            "gqa": LaunchConfig(tile_n=128, num_warps=8, num_stages=2, waves=4),
            "split_k": LaunchConfig(tile_n=64, num_warps=4, num_stages=3, waves=4, scratch_div=8,
                                    merge_partials=0)}
# gqa on a short grid (B·Hkv ≤ 2·SMs: one or two programs per SM)
GQA_SHORT_GRID = dict(num_warps=4, num_stages=3)


# split_k on a query group of 32 heads (MQA of a 32-head model) with 16-bit rows of ≤ 128
# elements: 32-token tiles, 6 stages (96 KB of K/V buffers a program). Measured 1.037–1.083 ×
# the default on all six group-32 shapes timed (MQA B16 4k 19.1 → 18.2 µs, B1–B64, ctx 512–16k;
# notes/triton.md, Session 31, run 263); 3 or 4 stages at 32 tokens were 9–25 % slower. Other
# groups were not timed with it.
WIDE_GROUP = 32
SPLIT_K_WIDE_GROUP = dict(tile_n=32, num_stages=6)


def split_k_config(group, row_bytes) -> LaunchConfig:
    """split_k's default config for a query group of ``group`` heads and K/V rows of
    ``row_bytes`` (padded head dim × element size)."""
    config = DEFAULTS["split_k"]
    if group == WIDE_GROUP and row_bytes <= 256:
        return dataclasses.replace(config, **SPLIT_K_WIDE_GROUP)
    return config


def launch_config(mode, batch, kv_heads, sm_count, group=1, row_bytes=256) -> LaunchConfig:
    """The mode's default config for this grid. gqa with B·Hkv ≤ 2·SMs takes GQA_SHORT_GRID:
    3 stages measured 1–3 % faster on the B·Hkv 256 rows (notes/triton.md, Session 5), and on 4 warps
    another 0.3–0.8 % (llama7b-8k 346.6 → 344.7 µs, Session 6). Larger gqa grids keep the
    8 warps × 2 stages the sweeps validated (3 stages there were within ±2 % in one sweep: not
    enough to change). split_k: ``split_k_config``."""
    if mode == "split_k":
        return split_k_config(group, row_bytes)
    config = DEFAULTS[mode]
    if mode == "gqa" and batch * kv_heads <= 2 * sm_count:
        return dataclasses.replace(config, **GQA_SHORT_GRID)
    return config


def segments_for(batch, kv_heads, group, max_tokens, sm_count,
                 cfg: LaunchConfig = DEFAULTS["split_k"], tile=None) -> int:
    """Enough (B, Hkv, segment) programs for ``cfg.waves`` waves, each segment at least one tile
    of ``tile`` tokens (default ``cfg.tile_n``), within ``cfg.scratch_div``'s scratch cap."""
    n_seg = min(math.ceil(cfg.waves * sm_count / (batch * kv_heads)),
                math.ceil(max_tokens / (tile or cfg.tile_n)))
    if cfg.scratch_div:
        n_seg = min(n_seg, max_tokens // (cfg.scratch_div * group))
    return max(1, n_seg)


def reduce_warps(seg_pad, d_pad) -> int:
    """Warps of a reduce program (one query head): as few as keep ~MERGE_ELEMS_PER_THREAD
    partial elements a thread — measured, 1 warp instead of 4 takes MQA B16 from 19.8–20.2 to
    17.7 µs and llama70b B4 from 15.6–15.8 to 14.9–15.0 (notes/triton.md, Session 5)."""
    return min(8, max(1, seg_pad * d_pad // (32 * MERGE_ELEMS_PER_THREAD)))


# --- paged decode: the auto rule ---

# choose_mode: gqa from this many programs an SM on (B·Hkv 1024: 1–9 % ahead, 2048: 2–12 %).
GQA_FROM_PER_SM = 4


def choose_mode(batch, heads, kv_heads, max_tokens, sm_count) -> str:
    """The ``auto`` rule, from the sweeps of notes/triton.md (Sessions 3 and 5):
    split_k wherever B·Hkv < SMs (one program per KV head leaves SMs idle); gqa from one to two
    programs per SM (B·Hkv 256: 10–12 % ahead) and from 4 per SM on (B·Hkv 1024: 1–9 %, 2048:
    2–12 %); between them split_k (B·Hkv 512: 6–8 % ahead from 4k tokens, its 2 segments per
    KV head as 3 small programs per SM against gqa's one 128 KB program)."""
    programs = batch * kv_heads
    if sm_count <= programs <= 2 * sm_count or programs >= GQA_FROM_PER_SM * sm_count:
        return "gqa"
    return "split_k"


# Where choose_mode says split_k, mode="cuda" takes the row instead (where it applies) when its
# K/V reach CUDA_SPLIT_FROM_BYTES or B·Hkv reaches CUDA_SPLIT_FROM_SM_SHARE of the SMs. Measured
# on the 82-shape sweep's split_k rows (notes/triton.md, Session 24, runs 156 and 158): from
# 268 MB up cuda ran at 0.961–1.001 × split_k, and at B·Hkv 128 / 512 at 0.87–0.98 ×; at
# B·Hkv ≤ 64 with 2–134 MB it ran at 0.995–1.63 ×.
CUDA_SPLIT_FROM_BYTES = 200 * 2**20
CUDA_SPLIT_FROM_SM_SHARE = 0.75


def paged_prefers_cuda(mode, kv_bytes, pairs, sm_count) -> bool:
    """``auto``'s turn to the CUDA kernel, where it applies: in place of gqa (on the 13 sweep
    shapes that go to gqa it ran at 0.960–1.015 × the best Triton mode, notes/triton.md,
    Session 23), and of split_k on big caches or about one KV head an SM (above)."""
    return (mode == "gqa" or kv_bytes >= CUDA_SPLIT_FROM_BYTES
            or pairs >= CUDA_SPLIT_FROM_SM_SHARE * sm_count)


# --- fused decode ---

def fused_num_warps(head_dim: int) -> int:
    """4 warps; 2 at D 64, where a (16, 64) query-group tile leaves 4 warps little to share:
    Qwen2.5-0.5B B 64 (14/2 heads, 456 positions), 24 layers in a graph: 9.3 against 10.7 µs
    a layer at position 328, 10.3 against 12.3 at 450 (notes/rollout.md, Session 17)."""
    return 2 if head_dim <= 64 else 4
FUSED_WAVES = 2  # aim the (B, Hkv, segment) grid at this many waves of programs
FUSED_MAX_SEGMENTS = 16  # the in-kernel merge reads ≤ 16 partial rows a head


def fused_segments(batch, kv_heads, capacity, sm_count, tile) -> int:
    """Context segments per (sequence, KV head): enough programs for FUSED_WAVES waves, each segment
    at least one tile, at most FUSED_MAX_SEGMENTS; shapes only."""
    return max(1, min(math.ceil(FUSED_WAVES * sm_count / (batch * kv_heads)),
                      math.ceil(capacity / tile), FUSED_MAX_SEGMENTS))


# The fused step's CUDA kernel pays where one CTA per (sequence, KV head) fills the GPU: in the
# rollout's step (B·Hkv 128) 0.894 → 0.876 ms (notes/rollout.md, Session 25); with fewer pairs
# the Triton kernel's context segments keep more SMs busy.
FUSED_CUDA_SM_SHARE = 0.75


def fused_prefers_cuda(batch, kv_heads, sm_count) -> bool:
    """``auto``'s turn to the fused CUDA kernel, where it applies
    (``fused_decode_cuda.supports``)."""
    return batch * kv_heads >= FUSED_CUDA_SM_SHARE * sm_count
