"""Decode attention: one query token per sequence against a KV cache.

``paged.py`` (Triton: v1 / gqa / split_k) and ``paged_cuda.py`` + ``paged_cuda.cu`` (hand-written
CUDA) behind one ``paged_attention(..., backend=, mode=)``; ``fused_decode.py`` (Triton: RoPE +
KV write + attention) and ``fused_decode_cuda.py`` + ``.cu`` behind
``fused_decode_attention(..., backend=)``. What the Triton files share is ``triton_common.py``,
what the CUDA files share ``cubin.py`` + ``cuda_common.cuh``, and the measured dispatch rules
``heuristics.py``."""
