"""With automatic syncs off, shared-memory reuse still merges buffers by program-order liveness.

With ``tl.disable_thread_storage_sync`` the kernel places its own barriers, yet TileLang 0.1.15
still plans shared memory as if a barrier separated one buffer's last read from the next
buffer's first write. Below, two warpgroups each run a wgmma over ``k_s`` and then write their
rows of ``o_s``; the kernel's own ``T.sync_threads()`` order every other shared access (loads
before the GEMM, the O stores before the TMA store). TileLang gives ``o_s`` the bytes of
``k_s``, so the warpgroup that finishes its GEMM first overwrites K while the other's wgmma may
still read it. Without the reuse the kernel is race-free. The control is the same kernel with
automatic syncs on: TileLang then inserts the ``__syncthreads()`` that makes the reuse safe.
"""
import re

import tilelang
import tilelang.language as T

from ws_lab.upstream import lower_sm90a, verdict

TITLE = "Shared-memory reuse merges buffers across warpgroups when thread-storage sync is disabled"
TRIAGE = "wrong code"
IMPACT = ("wrong values by a race: one warpgroup's O stores land on K while the other "
          "warpgroup's wgmma may still read it; no GPU run of this kernel (the race needs the "
          "second warpgroup to lag)")
LINKS = ("https://github.com/tile-ai/tilelang/issues/2416 — this behaviour (open, no repro "
         "yet): post this as a comment there",)
PASS_CONFIGS = {tilelang.PassConfigKey.TL_DISABLE_THREAD_STORAGE_SYNC: True}
CONTROL_PASS_CONFIGS = {}  # automatic syncs on
EXPECTED = ("with automatic syncs off, o_s and k_s get disjoint shared memory (TileLang cannot "
            "know that the two warpgroups' lifetimes of k_s and o_s are ordered)")
WORKAROUND = "add tl.disable_shared_memory_reuse whenever tl.disable_thread_storage_sync is set"
EXCERPT = r"buf_dyn_shmem \+|__syncthreads|wgmma_ss|o_s\)\["


def kernel():
    @T.prim_func
    def two_consumers(Q: T.Tensor([128, 64], "float16"), K: T.Tensor([128, 64], "float16"),
                      Out: T.Tensor([128, 64], "float16"), QOut: T.Tensor([128, 64], "float16")):
        with T.Kernel(1, threads=256) as _:
            q_s = T.alloc_shared([128, 64], "float16")
            k_s = T.alloc_shared([128, 64], "float16")
            o_s = T.alloc_shared([128, 64], "float16")
            acc = T.alloc_fragment([128, 128], "float")
            out = T.alloc_fragment([128, 64], "float")
            T.copy(Q, q_s)
            T.copy(K, k_s)
            T.sync_threads()  # the loads, before either warpgroup's wgmma reads them
            T.gemm(q_s, k_s, acc, transpose_B=True, clear_accum=True,
                   policy=T.GemmWarpPolicy.FullRow)  # warpgroup w: rows 64w..64w+63
            for i, j in T.Parallel(128, 64):
                out[i, j] = acc[i, 2 * j]
            T.copy(out, o_s)  # each thread its own rows: no barrier needed, unless o_s is k_s
            T.sync_threads()  # the O stores, before the TMA store reads them
            T.copy(o_s, Out)
            T.copy(q_s, QOut)  # q_s stays live to the end, so o_s can only take k_s's bytes

    return two_consumers


def control():
    """The same kernel, lowered with CONTROL_PASS_CONFIGS (automatic syncs on)."""
    return kernel()


def lower():
    return lower_sm90a(kernel(), PASS_CONFIGS)


def _reading(source: str) -> tuple[bool, bool, str]:
    """(o_s overlaps k_s, a __syncthreads() lies between the last wgmma and the first o_s
    store, the offsets)."""
    off = {m.group(1): int(m.group(2)) for m in re.finditer(
        r"void\* (\w+) = \(\(void\*\)\(\(char\*\)buf_dyn_shmem \+ (\d+)\)\)", source)}
    if not {"k_s", "o_s"} <= set(off):
        return False, False, f"offsets found: {off}"
    overlap = abs(off["k_s"] - off["o_s"]) < 128 * 64 * 2
    body = source[source.rfind("__global__"):]
    gemm, store = body.rfind("wgmma_ss"), body.find("((half_t*)o_s)[")
    synced = 0 <= gemm < store and "__syncthreads" in body[gemm:store]
    return overlap, synced, f"offsets {off}"


def check():
    """Fixed when o_s does not take k_s's bytes without a barrier after the GEMM (each buffer
    16 KB). The control, lowered with automatic syncs on, must show that barrier."""
    overlap, synced, offsets = _reading(lower())
    c_overlap, c_synced, c_offsets = _reading(lower_sm90a(control(), CONTROL_PASS_CONFIGS))
    hazard = overlap and not synced
    control_ok = not c_overlap or c_synced
    detail = (f"syncs off: {offsets}, o_s {'overlaps' if overlap else 'is disjoint from'} k_s, "
              f"{'a' if synced else 'no'} barrier between the GEMM and the O stores; control "
              f"(syncs on): {c_offsets}, {'a' if c_synced else 'no'} barrier there")
    return verdict(hazard and control_ok, not hazard and control_ok, detail)
