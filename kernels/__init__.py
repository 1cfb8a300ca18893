"""One kernel family per file. Constants every family shares live here (no framework imports)."""

LOG2E = 1.4426950408889634  # scores are scaled by scale · log2(e) and exponentiated with exp2


def qtile_grid(n_qtiles, heads, batch, heavy_first):
    """A forward kernel's (Q tile, head, batch) grid and its map (blockIdx.x, blockIdx.y) ->
    (Q tile, head). ``heavy_first`` puts heads on x and the Q tiles, reversed, on y: blocks
    launch x-fastest, so every head's longest causal tile goes out before any shorter one."""
    if heavy_first:
        return (heads, n_qtiles, batch), lambda gx, gy: (n_qtiles - 1 - gy, gx)
    return (n_qtiles, heads, batch), lambda gx, gy: (gx, gy)
