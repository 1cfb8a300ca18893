"""The in-kernel FP8 V transpose (kernels/fwd/v_transpose.py) on the CPU: its lane-to-row maps
run through a numpy model of LDSM.T x4, PRMT and STSM x4 (PTX ISA: ldmatrix / stmatrix
m8n8.b16, __byte_perm), against Vᵀ with its keys in ``coop.operand_key``'s order (what the RS
design's P columns need); and the kernel lowered for sm_90a: one LDSM.T and one STSM a unit
in the producer's loop, no spill at its register budget, the smem within the H100's."""
import shutil

import numpy as np
import pytest

from tests.ws.v_transpose_kernel import transpose_block_kernel
from ws_lab import emit, registry, shapes
from ws_lab.kernels.fwd import coop, fp8, v_transpose

H100_SMEM_BYTES = 227 * 1024
needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc not on PATH")


def byte_perm(a: int, b: int, selector: int) -> int:
    """CUDA's __byte_perm: byte i of the result is byte (selector >> 4i) & 7 of b:a."""
    pool = a | b << 32
    return sum(((pool >> 8 * ((selector >> 4 * i) & 7)) & 0xFF) << 8 * i for i in range(4))


def ldsm_trans_x4(rows: list[bytes]) -> list[list[int]]:
    """ldmatrix.x4.trans.b16: ``rows[l]`` the 16 bytes lane l addresses (row l % 8 of matrix
    l // 8); lane t's register m holds column t // 4, rows 2(t % 4) and 2(t % 4) + 1 of matrix m
    (each a little-endian b16)."""
    def b16(m, r, c):
        row = rows[8 * m + r]
        return row[2 * c] | row[2 * c + 1] << 8

    return [[b16(m, 2 * (t % 4), t // 4) | b16(m, 2 * (t % 4) + 1, t // 4) << 16
             for m in range(4)] for t in range(32)]


def stsm_x4(regs: list[list[int]]) -> list[bytes]:
    """stmatrix.x4.b16: the 16 bytes written at lane l's address (row l % 8 of matrix l // 8):
    lane t's register m is row t // 4, b16 columns 2(t % 4) and 2(t % 4) + 1 of matrix m."""
    rows = []
    for lane in range(32):
        m, r = divmod(lane, 8)
        words = [regs[4 * r + q][m] for q in range(4)]
        rows.append(b"".join(w.to_bytes(4, "little") for w in words))
    return rows


def model_transpose(v: np.ndarray) -> np.ndarray:
    """v (bn, Dv) uint8 -> what the transposing warps write: (Dv, bn), every round of every warp
    through the kernel's address maps and instructions."""
    block_n, head_dim_v = v.shape
    out = np.full((head_dim_v, block_n), -1, dtype=np.int16)
    for warp in range(v_transpose.TRANSPOSE_WARPS):
        for i in range(v_transpose.rounds_per_block(block_n, head_dim_v)):
            key0, dim0 = v_transpose.unit_origin(warp, i, head_dim_v)
            rows = []
            for lane in range(32):
                key, dim = v_transpose.ldsm_row(lane)
                rows.append(v[key0 + key, dim0 + dim:dim0 + dim + 16].tobytes())
            regs = []
            for lane, r in enumerate(ldsm_trans_x4(rows)):
                first, second = v_transpose.slot_selectors(lane)
                regs.append([byte_perm(r[0], r[1], first), byte_perm(r[0], r[1], second),
                             byte_perm(r[2], r[3], first), byte_perm(r[2], r[3], second)])
            for lane, row in enumerate(stsm_x4(regs)):
                dim = dim0 + v_transpose.stsm_row(lane)
                assert (out[dim, key0:key0 + 16] == -1).all(), "a byte written twice"
                out[dim, key0:key0 + 16] = np.frombuffer(row, dtype=np.uint8)
    return out


def test_the_byte_perm_model_follows_cudas_selector():
    assert byte_perm(0x33221100, 0x77665544, 0x6420) == 0x66442200
    assert byte_perm(0x33221100, 0x77665544, 0x7531) == 0x77553311


@pytest.mark.parametrize("block_n,head_dim_v", [(224, 128), (256, 128), (224, 64), (64, 32)])
def test_the_transposing_warps_write_vt_in_the_operand_key_order(block_n, head_dim_v):
    """Every byte once (``model_transpose`` refuses a second write), none left (-1)."""
    v = np.random.default_rng(0).integers(0, 256, (block_n, head_dim_v), dtype=np.uint8)
    keys = [coop.operand_key(a) for a in range(block_n)]
    assert (model_transpose(v) == v[keys, :].T).all()


def wavefronts(byte_addresses) -> int:
    """Shared-memory wavefronts of one LDSM / STSM phase (8 lanes, 16 bytes each): the most
    distinct 4-byte words any of the 32 banks serves."""
    words = {}
    for address in byte_addresses:
        for word in range(address // 4, address // 4 + 4):
            words.setdefault(word % 32, set()).add(word)
    return max(len(w) for w in words.values())


def layout_offset(buffer_shape, index) -> int:
    """The byte offset of an e4m3 element of a shared (rows, cols) buffer under TileLang's
    swizzled layout (``coop.swizzled``), read from the layout's own index map."""
    from tilelang import tvm
    from tilelang.layout import make_swizzled_layout

    layout = make_swizzled_layout(tvm.tirx.decl_buffer(buffer_shape, coop.FP8_DTYPE,
                                                       scope="shared.dyn"))
    offset = 0
    for i, extent in zip(layout.map_forward_index([tvm.tirx.const(i, "int32") for i in index]),
                         layout.get_output_shape()):
        offset = offset * int(extent) + int(tvm.arith.Analyzer().simplify(i))
    return offset


@pytest.mark.parametrize("block_n,head_dim_v", [(224, 128), (224, 64), (256, 128)])
def test_every_ldsm_and_stsm_phase_is_one_wavefront(block_n, head_dim_v):
    """At bn 224 Vᵀ's rows are 224 bytes, so TileLang swizzles them by 32 bytes (at 256, by
    128): either way a phase's 8 rows must be 8 dims of distinct residues mod 8
    (``slot_selectors``), or it takes two."""
    import functools

    src = functools.partial(layout_offset, (block_n, head_dim_v))
    dst = functools.partial(layout_offset, (head_dim_v, block_n))
    phases = []
    for warp in range(v_transpose.TRANSPOSE_WARPS):
        for i in range(v_transpose.rounds_per_block(block_n, head_dim_v)):
            key0, dim0 = v_transpose.unit_origin(warp, i, head_dim_v)
            for lanes in (range(m, m + 8) for m in range(0, 32, 8)):
                phases.append((
                    wavefronts([src((key0 + v_transpose.ldsm_row(l)[0],
                                     dim0 + v_transpose.ldsm_row(l)[1])) for l in lanes]),
                    wavefronts([dst((dim0 + v_transpose.stsm_row(l), key0)) for l in lanes])))
    assert set(phases) == {(1, 1)}


@pytest.mark.parametrize("block_n,head_dim_v", [(200, 128), (224, 256), (224, 48), (48, 32),
                                                (224, 16)])
def test_the_transposer_refuses_a_block_its_warps_do_not_tile(block_n, head_dim_v):
    with pytest.raises(ValueError, match="in-kernel V transpose gives each of 4 warps"):
        v_transpose.check_config(block_n, head_dim_v)


def test_transpose_v_is_the_rs_designs_option_only():
    with pytest.raises(ValueError, match="transpose_v is the non-persistent FP8 kernel's option"):
        coop.coop_fwd(1, 127, 4, 2, 64, 64, True, coop.FP8_DTYPE, 0.125,
                      coop.Config(224, 2, True, transpose_v=True),
                      fp8.coop_mainloop(fp8.coop_config_for(True)))


@needs_nvcc
def test_the_one_block_transpose_kernel_lowers_with_syncs_around_the_move(tmp_path):
    """The GPU test's kernel (tests/ws/v_transpose_kernel.py): TileLang's own syncs order the
    copy in, the four warps' LDSM / STSM and the copy out (this kernel keeps them on)."""
    shape = shapes.Shape("vt-block", 1, 1, 1, 224, 128, 128, False, "float8_e4m3fn")
    emitted = emit.lower_variant("vt-block", shape, transpose_block_kernel(224, 128), {})
    body = emitted.source[emitted.source.index("__global__"):]
    ldsm, stsm = body.index("tl::ptx_ldmatrix_x4_trans("), body.index("tl::ptx_stmatrix_m8n8_x4(")
    assert "__syncthreads();" in body[:ldsm] and "__syncthreads();" in body[stsm:]
    summary = emit.inspect(emitted, tmp_path)
    assert summary.counts["LDSM"] == summary.counts["STSM"] == 14, summary.format()
    assert summary.spill_bytes == 0, summary.format()


@needs_nvcc
@pytest.mark.parametrize("name,causal", [("train8b-8k", False), ("llama8b-4k", True),
                                         ("d64-4k", True)])
def test_the_rs_vt_design_transposes_with_one_ldsm_and_one_stsm_a_unit(tmp_path, name, causal):
    """``design="coop-overlap-rs-vt"``: the RS design's consumer loop (the same HGMMAs), V's
    TMA block read back by LDSM.T and written by STSM in the producer (within its 24
    registers), its rounds unrolled (one LDSM and one STSM a round in the SASS: their
    addresses are a base and an immediate), no spill, the shared memory within 227 KB."""
    shape = shapes.SHAPES[name]
    shape = shapes.Shape(shape.name, shape.batch, shape.heads, shape.kv_heads, shape.seq_len,
                         shape.head_dim, shape.head_dim_v, causal, shape.dtype)
    design = "coop-overlap-rs-vt"
    passes = registry.get("fp8-coop-rs-vt").postproc_passes
    emitted = emit.lower_variant("fp8-coop-rs-vt", shape, fp8.prim_func_for(shape, design=design),
                                 fp8.coop.PASS_CONFIGS, passes)
    summary = emit.inspect(emitted, tmp_path)
    d = shape.head_dim
    assert set(summary.hgmma) == {f"64x{d}x32.F32.E4M3.E4M3.RS", "64x224x32.F32.E4M3.E4M3"}, \
        summary.format()
    assert summary.spill_bytes == 0 and summary.stack_frame == 0, summary.format()
    assert "DEALLOC 24" in summary.setmaxnreg, summary.format()
    assert emitted.source.count("tl::ptx_ldmatrix_x4_trans(") == 1
    assert emitted.source.count("tl::ptx_stmatrix_m8n8_x4(") == 1
    rounds = v_transpose.rounds_per_block(224, shape.head_dim_v)
    assert summary.counts["LDSM"] == summary.counts["STSM"] == rounds, summary.format()
    assert summary.dyn_smem <= H100_SMEM_BYTES
