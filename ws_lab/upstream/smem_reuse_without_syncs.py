"""With automatic syncs off, shared-memory reuse still merges buffers by program-order liveness.

TileLang 0.1.15 with ``tl.disable_thread_storage_sync`` still plans shared memory as if a
barrier separated one buffer's last read from the next buffer's first write. In a warp-specialized
kernel one consumer warpgroup reaches its epilogue (writing the O tile) while the other still reads
K through wgmma, so giving O the bytes of K corrupts the other warpgroup's GEMM. This is the
mechanism behind the seed coop kernel's D = 64 "shared-memory alias" failure: O (128×64, 16 KB)
fits into a dead-looking K/V buffer there. (The lab's rewritten coop kernel, lowered with reuse on
and a separate O buffer, got disjoint offsets at D 64 and 128 — checked 2026-11-22 — but nothing
guarantees it, so it keeps reuse off.) Upstream: tilelang #2416.
"""
import tilelang
import tilelang.language as T

from ws_lab.upstream import lower_sm90a, verdict

PASS_CONFIGS = {tilelang.PassConfigKey.TL_DISABLE_THREAD_STORAGE_SYNC: True}
EXPECTED = ("o_s and k_s get disjoint shared memory: with automatic syncs off, TileLang cannot "
            "know that the two warpgroups' lifetimes of k_s and o_s are ordered")
WORKAROUND = ("kernels/coop.py compiles with tl.disable_shared_memory_reuse and writes each "
              "warpgroup's O into its own half of the Q buffer, which only it reads")

UPSTREAM = "tilelang #2416"
TITLE = "Shared-memory reuse merges buffers across warpgroups when thread-storage sync is disabled"


def kernel():
    @T.prim_func
    def two_consumers(K: T.Tensor([256, 64], "float16"), Out: T.Tensor([128, 64], "float16")):
        with T.Kernel(1, threads=256) as _:
            q_s = T.alloc_shared([128, 64], "float16")
            k_s = T.alloc_shared([128, 64], "float16")
            o_s = T.alloc_shared([128, 64], "float16")
            acc = T.alloc_fragment([128, 128], "float")
            out = T.alloc_fragment([128, 64], "float")
            T.clear(q_s)
            T.clear(out)
            T.clear(acc)
            for kb in T.serial(2):  # both warpgroups read k_s through wgmma...
                T.copy(K[kb * 128:(kb + 1) * 128, :], k_s)
                T.gemm(q_s, k_s, acc, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
                for i, j in T.Parallel(128, 64):
                    out[i, j] += acc[i, 2 * j]
            T.copy(out, o_s)  # ...and the first one done writes its O rows here
            T.copy(o_s, Out)
            T.copy(q_s, K[0:128, :])  # q_s stays live to the end

    return two_consumers


def lower():
    return lower_sm90a(kernel(), PASS_CONFIGS)


def offsets(source: str) -> dict:
    """Byte offset of each buffer in the dynamic shared memory, as the emitted CUDA states it."""
    import re

    return {m.group(1): int(m.group(2)) for m in
            re.finditer(r"void\* (\w+) = \(\(void\*\)\(\(char\*\)buf_dyn_shmem \+ (\d+)\)\)", source)}


def check():
    """Fixed when o_s does not take the bytes of k_s, which the other warpgroup
    may still be reading (each buffer 16 KB)."""
    off = offsets(lower())
    size = 128 * 64 * 2
    if not {"k_s", "o_s"} <= set(off):
        return verdict(False, False, f"offsets found: {off}")
    overlap = abs(off["k_s"] - off["o_s"]) < size
    return verdict(overlap, not overlap, f"offsets {off} (each buffer {size} B): k_s and o_s "
                                         f"{'overlap' if overlap else 'are disjoint'}")
