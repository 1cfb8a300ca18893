"""Tile schedulers of the forward kernels (FA3's ``hopper/tile_scheduler.hpp``; FA-CuTe's
``flash_attn/cute/tile_scheduler.py``): which (Q tile, head, batch) each CTA computes.

``qtile_grid``: the non-persistent grid, one CTA a tile, optionally heaviest causal tile first
(FA3's ``SingleTileScheduler``). ``PersistentScheduler``: one CTA per SM walking a static tile
list (FA3's ``StaticPersistentTileScheduler``), rounds zigzagging, tiles numbered heaviest
first, and, when the call's K/V exceed half of L2, in groups of RANK_GROUP Q tiles of one head
(``tile_rank``) or on 2-CTA clusters sharing each K/V block (``cluster_for``).
"""
from dataclasses import dataclass

import torch

# Persistent walk: when the call's K/V exceed half of L2, RANK_GROUP Q tiles of one head run on
# neighbouring CTAs, so the ~132 resident tiles read the K/V of a few heads, not of all of them.
RANK_GROUP = 16


def qtile_grid(n_qtiles, heads, batch, heavy_first):
    """A forward kernel's (Q tile, head, batch) grid and its map (blockIdx.x, blockIdx.y) ->
    (Q tile, head). ``heavy_first`` puts heads on x and the Q tiles, reversed, on y: blocks
    launch x-fastest, so every head's longest causal tile goes out before any shorter one."""
    if heavy_first:
        return (heads, n_qtiles, batch), lambda gx, gy: (n_qtiles - 1 - gy, gx)
    return (n_qtiles, heads, batch), lambda gx, gy: (gx, gy)


def kv_exceed_half_l2(batch, seq_len, kv_heads, head_dim, head_dim_v, l2_bytes,
                      elem_bytes=2) -> bool:
    """The call's K and V (``elem_bytes`` a element: 1 for e4m3) do not fit in half of L2: the
    line above which the persistent walk groups Q tiles by head and runs CTA pairs."""
    return batch * kv_heads * seq_len * (head_dim + head_dim_v) * elem_bytes > l2_bytes // 2


def cluster_for(batch, seq_len, heads, kv_heads, head_dim, head_dim_v, l2_bytes,
                elem_bytes=2) -> int:
    """CTAs per cluster of the persistent walk: 2 (two Q heads of one GQA group on a CTA pair,
    each K/V block loaded once and multicast into both) when the group is even and the call's
    K/V exceed half of L2; else 1. Measured against single CTAs (notes/coop_overlap.md, Session
    11): +1 to +7 % at 32–64 MB of K/V (±1 % on the full-mask 32 MB row), −1 % at 16 MB, where
    L2 holds them."""
    group_even = (heads // kv_heads) % 2 == 0
    big = kv_exceed_half_l2(batch, seq_len, kv_heads, head_dim, head_dim_v, l2_bytes, elem_bytes)
    return 2 if group_even and big else 1


def tile_rank(tile, n_qtiles, head_batches, rank_group, select):
    """A persistent walk's tile number -> (rank: 0 = the heaviest Q tile, head + heads·batch).
    Heads fastest, or — rank_group > 1 — full groups of rank_group ranks run one head's ranks
    on consecutive tiles and the ranks past the last full group go heads first. ``select`` is
    ``T.if_then_else`` in the kernel (a Python conditional in tests)."""
    if rank_group == 1:
        return tile // head_batches, tile % head_batches
    per_group = rank_group * head_batches
    grouped = n_qtiles // rank_group * per_group  # tiles in full groups
    rest = tile - grouped
    return (select(tile < grouped, tile // per_group * rank_group + tile % rank_group,
                   n_qtiles // rank_group * rank_group + rest // head_batches),
            select(tile < grouped, tile % per_group // rank_group, rest % head_batches))


def persistent_device_args(device) -> tuple[int, int]:
    """(SMs, L2 bytes) of the device: the persistent walk's CTA count and rank grouping."""
    props = torch.cuda.get_device_properties(device)
    return props.multi_processor_count, props.L2_cache_size


@dataclass(frozen=True)
class PersistentScheduler:
    """The persistent walk of ``num_ctas`` CTAs over n_qtiles × heads × batch tiles. ``lanes``
    CTAs (a cluster) walk one list together, on adjacent heads; each round a walker takes one
    tile, rounds alternating direction (zigzag: walker w takes tile w of even rounds and tile
    #walkers-1-w of odd ones; without it CTA 0 took the heaviest tile of every causal round,
    measured slower than the non-persistent grid)."""
    n_qtiles: int
    heads: int
    batch: int
    num_ctas: int
    lanes: int = 1
    rank_group: int = 1
    heavy_first: bool = False

    @property
    def ctas(self) -> int:
        tiles = self.n_qtiles * self.heads * self.batch
        return min(self.num_ctas, tiles) // self.lanes * self.lanes

    @property
    def walkers(self) -> int:
        return self.ctas // self.lanes

    def walker_of(self, cta):
        return cta // self.lanes if self.lanes > 1 else cta

    def tiles_of(self, cta):
        """Tiles CTA ``cta`` walks: the last, partial round runs from the low walkers on even
        rounds, the high on odd."""
        import tilelang.language as T

        rounds, partial = divmod(self.n_qtiles * self.heads * self.batch // self.lanes,
                                 self.walkers)
        w = self.walker_of(cta)
        in_partial = w < partial if rounds % 2 == 0 else self.walkers - 1 - w < partial
        return rounds + T.cast(in_partial, "int32")

    def tile_coords(self, i, cta):
        """(Q tile, head, batch) of CTA ``cta``'s i-th tile."""
        import tilelang.language as T

        w = self.walker_of(cta)
        head_groups = self.heads // self.lanes
        tile = i * self.walkers + T.if_then_else(i % 2 == 0, w, self.walkers - 1 - w)
        rank, head_batch = tile_rank(tile, self.n_qtiles, head_groups * self.batch,
                                     self.rank_group, T.if_then_else)
        qt = self.n_qtiles - 1 - rank if self.heavy_first else rank
        head = head_batch % head_groups
        if self.lanes > 1:
            head = head * self.lanes + cta % self.lanes
        return qt, head, head_batch // head_groups
