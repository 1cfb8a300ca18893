"""FP8 Vᵀ made in shared memory by the producer warpgroup (issue #48; ``coop.Config.transpose_v``).

FA3 counterpart: ``hopper/mainloop_fwd_sm90_tma_gmma_ws.hpp``'s ``Transpose_V`` path (the
producer warpgroup reads V's TMA'd block with LDSM.T, permutes bytes and writes Vᵀ with STSM
while the consumers run their GEMMs). e4m3 wgmma reads B K-major only, so O = P V needs V's
block as (Dv, bn) with the keys contiguous; the lab's other FP8 designs get that from a Triton
pass over V in global memory before the kernel (``fp8.transpose_v``).

Roles (the producer warpgroup of ``kernels/fwd/coop.py``, threads 256..383, setmaxnreg 24):
  warp 0       first the TMA loads, one block ahead: Q, then K and V (as stored, into the
               source ring ``vsrc_s``) of block kb + 1 before block kb is transposed
  warps 0..3   per block kb: wait until V landed (vsrc_full) and the consumers freed the Vᵀ
               stage (v_empty); write the warp's share of Vᵀ; fence.proxy.async (the
               consumers' wgmma reads it through the async proxy); arrive on v_full and
               vsrc_empty
Each warp owns one 32-dim slice of the block (D 128; at D 64 two warps a slice, alternate
16-key rows), so its rounds step through the keys and every address is a base and an offset.
Barriers (mbarriers, per ring stage s): vsrc_full[s] (32 + the TMA's bytes), vsrc_empty[s]
(128: the block was read), v_full[s] (128: Vᵀ written and fenced), v_empty[s] (256, the
consumers, as in every coop kernel). ``barriers.py`` names the roles.
Shared memory: one (bn, Dv) e4m3 stage per ring stage beside coop's (Dv, bn) Vᵀ ring; at
bn 224, D 128, 2 stages 56 KB more: 220 KB.

The unit of work is 16 keys × 32 dims, one LDSM.T x4, four PRMT and one STSM x4 per warp.
LDSM.T's matrix m (lanes 8m … 8m+7 address its rows) is keys k + 8·(m % 2) + 0..7 at dims
d + 16·(m // 2) + 0..15, read as 8 × 8 b16; transposed, lane l holds for dims (d', d' + 1) =
(2·(l // 4), +1) of its matrix the keys 2·(l % 4) and 2·(l % 4) + 1, four bytes. Matrices 0 and
1 (keys 8 apart, same dims) combine by PRMT into one register a dim: the keys 2q, 2q+1, 2q+8,
2q+9 (q = l % 4), which is ``coop.operand_key``'s order for P's columns 4q … 4q+3 in registers.
STSM x4 writes those as rows of Vᵀ: row r of matrix m is dim d + 16·(m // 2) + 2·r, + 1 where
m is odd or r ≥ 4 but not both (``slot_selectors``), at keys k … k + 15. So Vᵀ's key columns come
out in the RS design's order with no extra step, and each phase's 8 rows hit 8 bank groups
(``tests/cpu/test_v_transpose.py`` models the three instructions in numpy, and the banks).
"""
import tvm
import tilelang.language as T

from ws_lab.kernels.fwd.pipeline import KVRing

UNIT_KEYS, UNIT_DIMS = 16, 32
TRANSPOSE_WARPS = 4  # the whole producer warpgroup (warp 0 issues the loads first)
TRANSPOSE_THREADS = 32 * TRANSPOSE_WARPS
# __byte_perm selectors: bytes 0 and 2 of each of two registers (a dim d'), bytes 1 and 3 (d' + 1)
EVEN_DIM_BYTES, ODD_DIM_BYTES = 0x6420, 0x7531
LDSM = tvm.ir.Op.get("tl.ptx_ldmatrix")
STSM = tvm.ir.Op.get("tl.ptx_stmatrix")


def check_config(block_n: int, head_dim_v: int):
    slices = head_dim_v // UNIT_DIMS
    if not slices or head_dim_v % UNIT_DIMS or TRANSPOSE_WARPS % slices or block_n % (
            UNIT_KEYS * TRANSPOSE_WARPS // slices):
        raise ValueError(f"the in-kernel V transpose gives each of {TRANSPOSE_WARPS} warps 32 "
                         f"dims of 16-key rows: Dv {head_dim_v} must be 32, 64 or 128 and "
                         f"block_n {block_n} whole rounds of them")


def rounds_per_block(block_n: int, head_dim_v: int) -> int:
    return block_n // UNIT_KEYS * (head_dim_v // UNIT_DIMS) // TRANSPOSE_WARPS


def unit_origin(warp, i, head_dim_v: int):
    """(first key, first dim) in the block of ``warp``'s round ``i``: the warp keeps one
    32-dim slice (ints or TileLang expressions)."""
    slices = head_dim_v // UNIT_DIMS
    key_stride = TRANSPOSE_WARPS // slices
    return (i * key_stride + warp // slices) * UNIT_KEYS, warp % slices * UNIT_DIMS


def ldsm_row(lane):
    """(key, dim) offsets, within a unit, of the 16-byte row of V that ``lane`` addresses."""
    matrix = lane // 8
    return matrix % 2 * 8 + lane % 8, matrix // 2 * 16


def stsm_row(lane):
    """Offset, within a unit, of the dim (the 16-byte row of Vᵀ) that ``lane`` addresses: row r
    of matrix m is dim 2r + 16·(m // 2), plus 1 where m is odd or r ≥ 4 but not both
    (``slot_selectors``)."""
    matrix, row = lane // 8, lane % 8
    return matrix // 2 * 16 + row * 2 + (matrix % 2 + row // 4) % 2


def slot_selectors(lane):
    """__byte_perm selectors of ``lane``'s STSM registers 0 and 2, and 1 and 3. Lanes 16..31
    hold rows 4..7 of each matrix and swap dim parity. A matrix's 8 rows are then 8 dims of
    distinct residues mod 8, one bank group each in the 32-byte-swizzled Vᵀ (bn 224): an STSM
    phase is one wavefront, not two (notes/fp8.md "Session 56")."""
    swap = lane // 16 * (EVEN_DIM_BYTES ^ ODD_DIM_BYTES)
    return EVEN_DIM_BYTES ^ swap, ODD_DIM_BYTES ^ swap


def block_mover(block_n: int, head_dim_v: int):
    """``move_block(vsrc_s, v_s, stage, warp, lane)``: one warp's share of a block, V's (bn,
    Dv) ``vsrc_s[stage]`` into Vᵀ's (Dv, bn) ``v_s[stage]`` (the keys of each 16 in
    ``coop.operand_key``'s order); the four warps together move it all."""
    check_config(block_n, head_dim_v)
    rounds = rounds_per_block(block_n, head_dim_v)

    @T.macro
    def move_unit(vsrc_s, v_s, stage, warp, i, lane, regs):
        key0, dim0 = unit_origin(warp, i, head_dim_v)
        src_key, src_dim = ldsm_row(lane)
        T.call_intrin("handle", LDSM, 1, 4,
                      T.access_ptr(vsrc_s[stage, key0 + src_key, dim0 + src_dim], "r", 16),
                      T.access_ptr(regs[0], "w", 4))
        first, second = (T.Cast("uint32", sel) for sel in slot_selectors(lane))
        T.call_intrin("handle", STSM, 0, 4,
                      T.access_ptr(v_s[stage, dim0 + stsm_row(lane), key0], "w", 16),
                      T.call_extern("uint32", "__byte_perm", regs[0], regs[1], first),
                      T.call_extern("uint32", "__byte_perm", regs[0], regs[1], second),
                      T.call_extern("uint32", "__byte_perm", regs[2], regs[3], first),
                      T.call_extern("uint32", "__byte_perm", regs[2], regs[3], second))

    @T.macro
    def move_block(vsrc_s, v_s, stage, warp, lane):
        regs = T.alloc_local([4], "uint32")
        for i in T.unroll(rounds):
            move_unit(vsrc_s, v_s, stage, warp, i, lane, regs)

    return move_block


def transposing_producer(block_n: int, stages: int, head_dim_v: int, load_k, load_v):
    """The producer warpgroup's KV loop with the transpose: ``produce(K, V, loaded, kv, b,
    kv_head, loop_range, warp, lane)``. ``loaded``: the KVStages the loads fill (K's ring and
    V's source ring ``vsrc_s`` with its barriers), ``kv``: the consumers' (Vᵀ in ``v_s``);
    ``load_k`` / ``load_v``: coop's loaders (``coop.kv_loaders``, V not transposed)."""
    move_block = block_mover(block_n, head_dim_v)
    ring = KVRing(stages)

    @T.macro
    def produce(K, V, loaded, kv, b, kv_head, loop_range, warp, lane):
        if warp == 0:
            load_k(K, loaded, b, kv_head, 0, 0)
            load_v(V, loaded, b, kv_head, 0, 0)
        for kb in T.serial(loop_range):
            if warp == 0:
                if kb + 1 < loop_range:  # one block ahead: no TMA latency before a transpose
                    load_k(K, loaded, b, kv_head, kb + 1, 0)
                    load_v(V, loaded, b, kv_head, kb + 1, 0)
            stage, phase = ring.at(kb)
            T.mbarrier_wait_parity(loaded.v_full[stage], phase)
            T.mbarrier_wait_parity(kv.v_empty[stage], phase ^ 1)
            move_block(loaded.v_s, kv.v_s, stage, warp, lane)
            T.fence_proxy_async()
            T.mbarrier_arrive(kv.v_full[stage])
            T.mbarrier_arrive(loaded.v_empty[stage])

    return produce
