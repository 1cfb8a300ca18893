"""The backward's tile scheduler (FA3's ``hopper/tile_scheduler.hpp`` in role): which K/V tile,
KV head and batch a CTA of the main kernels takes (``kv_grid`` / ``kv_tile``), which query
heads it walks (``slot_heads``) and in what order it visits their Q tiles (``q_walk``). Shared
by ``pipelined`` and ``ws``; pure index arithmetic on TIR or Python integers.
"""


def q_walk(it, steps, first, first_head, heads, n_qtiles, heads_inner):
    """(query head, Q tile) of a CTA's step ``it`` of ``heads · steps``, over query heads
    ``first_head`` … ``first_head + heads − 1`` and Q tiles ``first`` … ``n_qtiles − 1``
    (``pipelined.Config.heads_inner`` says in which order)."""
    if heads_inner:
        return first_head + it % heads, n_qtiles - 1 - it // heads
    return first_head + it // steps, first + it % steps


def slot_heads(slot, splits, group):
    """(KV head, first query head of its walk) of a grid slot when each KV head's group of
    ``group`` query heads is split over ``splits`` CTAs (``Config.head_splits``)."""
    kv_head = slot // splits
    return kv_head, kv_head * group + slot % splits * (group // splits)


def kv_grid(n_kvtiles, kv_heads, batch, causal):
    """The main kernel's grid (``kv_heads`` counts (KV head, head split) slots where the group
    is split: ``pipelined.Config.head_splits``). Causal: (KV head, batch) on x, K/V tiles on y,
    so every head's K/V tile 0 (the longest walk: every Q tile) launches before any tile 1
    (FA3's heaviest first); with the tiles on x the last heads' long tiles waited for a second
    wave (notes/bwd.md, "Session 36"). Full: the K/V tiles on x, so a head's CTAs run together
    and share its Q and dO tiles in L2."""
    if causal:
        return kv_heads * batch, n_kvtiles
    return n_kvtiles, kv_heads * batch


def kv_tile(gx, gy, n_kvtiles, kv_heads, causal):
    """(K/V tile, KV head, batch) of the CTA at (blockIdx.x, blockIdx.y) of ``kv_grid``."""
    tile, head_batch = (gy, gx) if causal else (gx, gy)
    return tile, head_batch % kv_heads, head_batch // kv_heads


def grouped_kv_tile(t, n_kvtiles, kv_heads, fill):
    """(K/V tile, KV head, batch) of CTA ``t`` of a 1-D grid of ``n_kvtiles`` × (KV head,
    batch) units, launched in groups of ``fill`` units: a group's K/V tiles in order (tile 0,
    the longest causal walk, first), its units fastest; the next group after. The CTAs
    resident together then read the Q / dO tiles of ``fill`` KV heads' groups, not of every
    head's (TileOPs' ``fill``; ``heuristics.kv_fill``). ``fill`` 1 is ``kv_grid``'s full
    order, ``fill`` = all units its causal one."""
    span = fill * n_kvtiles
    unit = t // span * fill + t % fill
    return t % span // fill, unit % kv_heads, unit // kv_heads


def kv_walk_steps(tile, n_qtiles, group, causal, ratio):
    """Steps of the CTA that holds K/V tile ``tile``: ``group`` query heads' Q tiles from the
    diagonal's (causal: Q tile ``ratio · tile``, ``ratio`` Q tiles a K/V tile) or from 0."""
    return group * (n_qtiles - (ratio * tile if causal else 0))


def steps_before(tile, kv_head, b, n_qtiles, n_kvtiles, kv_heads, group, causal, ratio):
    """``kv_walk_steps`` summed over every CTA before this one in (batch, KV head, K/V tile)
    order: a global step index for work spread over the launch (``ws.Config.zero_next``)."""
    def prefix(tiles):  # Σ kv_walk_steps over K/V tiles 0 … tiles − 1 (t(t − 1) is even)
        return group * (tiles * n_qtiles - (ratio * tiles * (tiles - 1) // 2 if causal else 0))

    return (b * kv_heads + kv_head) * prefix(n_kvtiles) + prefix(tile)
