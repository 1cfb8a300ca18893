"""Every barrier id of the lab's warp-specialized kernels, in one place (FA3's
``hopper/named_barrier.hpp``; FA-CuTe's ``flash_attn/cute/named_barrier.py``).

Hardware named barriers (``bar.sync`` / ``bar.arrive``; id 0 is ``__syncthreads``) are the
``NamedBarrier`` enum: a kernel takes the ids of its roles and no two roles of one kernel share
an id. The mbarriers (shared-memory transaction barriers) are allocated per kernel; their roles
are the same in every kernel and named here so docstrings can point at them:

  q_full[slot]    the producer warp's TMA of a Q tile landed (32 arrivals + the TMA's bytes)
  q_empty[slot]   persistent: both consumers stored their O out of the Q slot (256)
  k_full[s]       K of ring stage s landed (32 + bytes); v_full[s] the same for V
  k_empty[s]      every consumer thread released K of stage s (256; in a 2-CTA cluster 264:
                  lane 0 of each of the peer's 8 consumer warps arrives remotely); v_empty[s]
  vsrc_full[s]    FP8 with the in-kernel Vᵀ: V's block as stored landed (32 + bytes); v_full[s]
                  then counts the 96 transposing threads (kernels/fwd/v_transpose.py)
  vsrc_empty[s]   the transposing threads read V's block out of stage s (96)
"""
from enum import IntEnum


class NamedBarrier(IntEnum):
    """Hardware named barrier ids of the lab's warp-specialized kernels, forward and backward."""
    WARP_SCHEDULER_WG1 = 1  # pingpong: WG1 may issue its QK GEMM (256 = 128 sync + 128 arrive)
    WARP_SCHEDULER_WG2 = 2
    # WG1's 128 threads have written their O tile to shared memory; persistent FP8 with P in
    # registers, also before they write it again (the last tile's O store has read it)
    EPILOGUE_WG1 = 3
    EPILOGUE_WG2 = 4
    ROW_SUM = 5  # largehdv: WG1's final row sums are in smem for WG2 (128 arrive + 128 sync)
    # The backward's dQ staging, a consumer warpgroup's 128 threads (ids 10 and 11, one a
    # warpgroup; at 1 plane both warpgroups' 256 on id 10), twice a step: the last step's dQ
    # reduce-add has read its plane; this step's dQ is in it (TileLang's own syncs in that
    # automatically warp-specialized kernel take id 3)
    BWD_DQ_WG1 = 10
    BWD_DQ_WG2 = 11
    # FP8 forward: a warpgroup's 128 threads wrote its 64 rows of P (ids 7 and 8, one a
    # warpgroup); both warpgroups (256) wrote O before its TMA store
    FP8_P_WG1 = 7
    FP8_P_WG2 = 8
    FP8_O_TILE = 9


WARP_SCHEDULERS = (NamedBarrier.WARP_SCHEDULER_WG1, NamedBarrier.WARP_SCHEDULER_WG2)
EPILOGUES = (NamedBarrier.EPILOGUE_WG1, NamedBarrier.EPILOGUE_WG2)
FP8_P_BARRIERS = (NamedBarrier.FP8_P_WG1, NamedBarrier.FP8_P_WG2)
