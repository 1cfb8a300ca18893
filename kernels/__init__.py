"""The lab's kernels, one folder per kind (``fwd``, ``bwd``, ``decode``, ``step``) and one family
per file. Constants every family shares live here (no framework imports)."""

LOG2E = 1.4426950408889634  # scores are scaled by scale · log2(e) and exponentiated with exp2

# A kernel builder's ``batch`` that makes B a launch argument read from the tensors: one compile
# serves every batch (the training op, whose micro-batches vary; notes/bwd.md "Session 46").
DYNAMIC_BATCH = None


def batch_extent(batch):
    """``batch`` as a TileLang extent: an int as given; ``DYNAMIC_BATCH`` a dynamic symbol. The
    emitted kernel is the same but for an ``int batch`` parameter and 64-bit indices where B
    multiplies a stride."""
    if batch is not DYNAMIC_BATCH:
        return batch
    import tilelang.language as T  # here, so that the Triton families never import TileLang

    return T.dynamic("batch")
