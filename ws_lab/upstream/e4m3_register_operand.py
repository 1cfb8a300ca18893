"""An e4m3 P copied from a wgmma accumulator cannot be a register (RS) A operand: lowering stops
with "Layout infer conflict".

``kernel`` computes S = Q Kᵀ (e4m3, fp32 accumulator), copies it to an e4m3 fragment ``p`` and
issues O = P Vᵀᵀ with ``p`` from registers, as FA3's FP8 forward does. Within 16 columns the
accumulator gives a thread columns 2q, 2q+1, 2q+8, 2q+9 (q = lane % 4) while the e4m3 A operand
wants 4q … 4q+3, so the copy needs a layout TileLang 0.1.15 neither makes (no shuffles) nor
explains. The control takes p's column a from score column a − a % 16 + (a % 4 // 2)·8 +
(a % 16 // 4)·2 + a % 2 (a reorder the caller undoes by ordering Vᵀ's keys alike, FA3's
column permutation): every element stays in its thread, and it lowers to ``wgmma_rs`` e4m3.
"""
import tilelang.language as T

from ws_lab.upstream import lower_sm90a, verdict

TITLE = "e4m3 P copied from a wgmma accumulator is refused as a register A operand (layout infer conflict)"
TRIAGE = "enhancement"
IMPACT = ("an FP8 attention forward must send P through shared memory (an SS PV GEMM: a 16 KB "
          "store, a fence and a barrier per warpgroup and block) or reorder keys by hand")
LINKS = ("https://github.com/tile-ai/tilelang/issues/2954 — same family: copies of GEMM-operand "
         "fragments",)
PASS_CONFIGS = {}
EXPECTED = ("`T.copy(acc_s, p)` lowers: TileLang picks the key order (or emits the byte "
            "shuffles) that makes p an RS operand, and `wgmma_rs` e4m3 follows")
WORKAROUND = ("copy with the key reorder of the control and order Vᵀ's keys alike (lowers; "
              "correct on an H100 in an FP8 attention forward), or P through shared memory")
EXCERPT = r"wgmma_rs|__nv_cvt_float2_to_fp8x2"
FP8 = "float8_e4m3"
BN = 128


def _pv(reordered: bool):
    @T.prim_func
    def pv(Q: T.Tensor([64, 128], FP8), K: T.Tensor([BN, 128], FP8),
           VT: T.Tensor([128, BN], FP8), O: T.Tensor([64, 128], "float")):
        with T.Kernel(1, threads=128) as _:
            q_s = T.alloc_shared([64, 128], FP8)
            k_s = T.alloc_shared([BN, 128], FP8)
            vt_s = T.alloc_shared([128, BN], FP8)
            acc_s = T.alloc_fragment([64, BN], "float")
            p = T.alloc_fragment([64, BN], FP8)
            acc_o = T.alloc_fragment([64, 128], "float")
            T.copy(Q, q_s)
            T.copy(K, k_s)
            T.copy(VT, vt_s)
            T.wgmma_gemm(q_s, k_s, acc_s, transpose_B=True, clear_accum=True)
            T.wait_wgmma(0)
            if reordered:
                for i, a in T.Parallel(64, BN):
                    p[i, a] = acc_s[i, a - a % 16 + a % 4 // 2 * 8 + a % 16 // 4 * 2 + a % 2]
            else:
                T.copy(acc_s, p)
            T.wgmma_gemm(p, vt_s, acc_o, transpose_B=True, clear_accum=True)
            T.wait_wgmma(0)
            T.copy(acc_o, O)

    return pv


def kernel():
    return _pv(reordered=False)


def control():
    return _pv(reordered=True)


def _lowered(prim_func):
    """(CUDA, None) or (None, the lowering error's first line)."""
    try:
        return lower_sm90a(prim_func, PASS_CONFIGS), None
    except Exception as exc:  # TileLang raises its own error types from C++
        return None, str(exc).strip().splitlines()[0][:200]


def lower():
    return _lowered(kernel())[0] or ""


def _rs_e4m3(src) -> bool:
    return src is not None and "wgmma_rs<tl::DataType::kFloat8_e4m3" in src


def check():
    """Fixed when the plain copy lowers to an e4m3 wgmma_rs; the bug, a layout-infer conflict."""
    src, error = _lowered(kernel())
    control_src, control_error = _lowered(control())
    control_ok = _rs_e4m3(control_src)
    conflict = error is not None and "conflict" in error.lower()
    return verdict(control_ok and conflict, control_ok and _rs_e4m3(src),
                   f"plain copy: {error or 'lowered'}; key-reordered copy: "
                   f"{'wgmma_rs e4m3' if control_ok else control_error or 'no wgmma_rs'}")
