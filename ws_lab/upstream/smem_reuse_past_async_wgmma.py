"""Shared-memory reuse hands an operand of an in-flight wgmma to a later buffer.

With TileLang's automatic syncs on, ``MergeSharedMemoryAllocations`` still plans by program
order: a buffer's last use is the ``T.wgmma_gemm`` that reads it, though that wgmma runs on
until a ``T.wait_wgmma`` retires it. Below, two wgmmas read ``a_s``; after ``T.wait_wgmma(1)``
(the first done, the second still reading ``a_s``) the first accumulator is stored to ``c_s``.
TileLang gives ``c_s`` the bytes of ``a_s``, so the store overwrites an operand the second
wgmma may still read: its result is wrong whenever the store lands first. The control is the
same kernel that reads ``a_s`` once more after ``T.wait_wgmma(0)``: ``c_s`` then gets its own
bytes.
"""
import re

import tilelang.language as T

from ws_lab.upstream import lower_sm90a, verdict

TITLE = "Shared-memory reuse gives an operand of an in-flight wgmma to a later buffer"
TRIAGE = "wrong code"
IMPACT = ("wrong values by a race: in an attention backward whose loop had one iteration (so "
          "TileLang dropped the loop), the dQ staging tile took dS's bytes while the dK wgmma "
          "still read dS; dK came out NaN (fp16) or ~1e35 (bf16) on an H100")
LINKS = ("https://github.com/tile-ai/tilelang/issues/2416 — shared-memory reuse by "
         "program-order liveness (the variant with automatic syncs off)",
         "https://github.com/tile-ai/tilelang/pull/2185 — MergeSharedMemoryAllocations with "
         "per-epoch liveness (not in 0.1.15)")
PASS_CONFIGS = {}  # TileLang's defaults: automatic syncs and reuse on
EXPECTED = ("a_s stays live until the T.wait_wgmma that retires the last wgmma reading it, so "
            "c_s, written before that wait, gets disjoint shared memory")
WORKAROUND = ("read the operand after the retiring T.wait_wgmma (e.g. one element into a local), "
              "or set tl.disable_shared_memory_reuse")
EXCERPT = r"buf_dyn_shmem \+|wait_wgmma|c_s\) \+"


def _kernel(hold: bool):
    @T.prim_func
    def two_wgmmas(A: T.Tensor([64, 64], "float16"), B: T.Tensor([64, 64], "float16"),
                   Out1: T.Tensor([64, 32], "float"), Out2: T.Tensor([64, 64], "float"),
                   BOut: T.Tensor([64, 64], "float16")):
        with T.Kernel(1, threads=128) as _:
            a_s = T.alloc_shared([64, 64], "float16")
            b_s = T.alloc_shared([64, 64], "float16")
            c_s = T.alloc_shared([64, 32], "float")
            acc1 = T.alloc_fragment([64, 64], "float")
            acc2 = T.alloc_fragment([64, 64], "float")
            keep = T.alloc_local([1], "float16")
            T.copy(A, a_s)
            T.copy(B, b_s)
            T.wgmma_gemm(a_s, b_s, acc1, clear_accum=True)
            T.wgmma_gemm(a_s, b_s, acc2, transpose_B=True, clear_accum=True)
            T.wait_wgmma(1)  # acc1 done; the second wgmma may still read a_s
            T.copy(acc1[:, 0:32], c_s)
            T.wait_wgmma(0)
            if hold:
                keep[0] = a_s[0, 0]  # a_s read after the wait that retires its last reader
            T.copy(c_s, Out1)
            T.copy(acc2, Out2)
            T.copy(b_s, BOut)  # b_s stays live to the end: c_s can only take a_s's bytes

    return two_wgmmas


def kernel():
    return _kernel(hold=False)


def control():
    """The same kernel reading a_s once after T.wait_wgmma(0)."""
    return _kernel(hold=True)


def lower():
    return lower_sm90a(kernel(), PASS_CONFIGS)


def _reading(source: str) -> tuple[bool, bool, str]:
    """(c_s overlaps a_s, the first c_s store comes before wait_wgmma<0>, the offsets)."""
    off = {m.group(1): int(m.group(2)) for m in re.finditer(
        r"void\* (\w+) = \(\(void\*\)\(\(char\*\)buf_dyn_shmem \+ (\d+)\)\)", source)}
    if not {"a_s", "c_s"} <= set(off):
        return False, False, f"offsets found: {off}"
    overlap = abs(off["a_s"] - off["c_s"]) < 64 * 64 * 2
    body = source[source.rfind("__global__"):]
    store, wait0 = body.find("((float*)c_s) +"), body.find("wait_wgmma<0>")
    early = 0 <= store < wait0
    return overlap, early, f"offsets {off}"


def check():
    """Fixed when c_s, stored while the second wgmma may still read a_s, does not take a_s's
    bytes. The control (a_s read after the last wait) must keep them apart."""
    overlap, early, offsets = _reading(lower())
    c_overlap, _, c_offsets = _reading(lower_sm90a(control(), PASS_CONFIGS))
    hazard = overlap and early
    detail = (f"kernel: {offsets}, c_s {'overlaps' if overlap else 'is disjoint from'} a_s, "
              f"stored {'before' if early else 'after'} wait_wgmma<0>; control: {c_offsets}")
    return verdict(hazard and not c_overlap, not hazard and early and not c_overlap, detail)
