"""The lab's kernels, one folder per kind (``fwd``, ``bwd``, ``decode``, ``step``) and one family
per file. Constants every family shares live here (no framework imports)."""

LOG2E = 1.4426950408889634  # scores are scaled by scale · log2(e) and exponentiated with exp2
