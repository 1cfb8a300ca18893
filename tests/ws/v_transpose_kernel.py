"""A one-block kernel around the FP8 forward's in-kernel V transpose
(``kernels/fwd/v_transpose.block_mover``), for its own GPU test (tests/ws/test_fp8.py) and its
CPU lowering (tests/cpu/test_v_transpose.py): V's (bn, Dv) e4m3 block into shared memory with
the layout the forward's TMA writes, the producer warpgroup's four warps move it, Vᵀ back out."""
import tilelang.language as T

from ws_lab.kernels.fwd import coop, v_transpose

FP8 = "float8_e4m3fn"


def transpose_block_kernel(block_n: int, head_dim_v: int):
    move_block = v_transpose.block_mover(block_n, head_dim_v)

    @T.prim_func
    def main(V: T.Tensor([block_n, head_dim_v], FP8), Vt: T.Tensor([head_dim_v, block_n], FP8)):
        with T.Kernel(1, threads=v_transpose.TRANSPOSE_THREADS):
            vsrc_s = T.alloc_shared([1, block_n, head_dim_v], FP8)
            v_s = T.alloc_shared([1, head_dim_v, block_n], FP8)
            T.annotate_layout(coop.swizzled(vsrc_s, v_s))
            T.copy(V, vsrc_s[0, :, :])
            tx = T.get_thread_binding()
            move_block(vsrc_s, v_s, 0, tx // 32, tx % 32)
            T.fence_proxy_async()  # each writer's STSM before the TMA store, as in the forward
            T.copy(v_s[0, :, :], Vt)

    return main
