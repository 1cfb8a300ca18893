// Device code shared by the lab's hand-written CUDA decode kernels (paged_cuda.cu,
// fused_decode_cuda.cu): cp.async, ldmatrix, the m16n8k16 mma per element type, the XOR swizzle
// of 16-byte pieces that keeps ldmatrix over K and V rows free of bank conflicts, and the part
// both kernels share: a warp's online-softmax step over 16-token tiles in shared memory (a KV
// head's query group as the 16 rows of one mma tile) and the warps' merge in the mma layout.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <stdint.h>

namespace ws_lab {
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
// Byte offset of 16-byte piece `chunk` of row `row`: 8 rows at one piece land in 8 bank groups.
template <int ROW_BYTES>
__device__ __forceinline__ int swizzle(int row, int chunk) {
  return row * ROW_BYTES + ((chunk ^ (row & 7)) << 4);
}
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(src),
               "r"(valid ? 16 : 0));
}
// An L2 policy that marks lines as the first to evict: for bytes a kernel reads once (a decode
// step's K/V context), so they do not push out what later kernels will read (prefetched weights).
__device__ __forceinline__ uint64_t l2_evict_first_policy() {
  uint64_t policy;
  asm volatile("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;\n" : "=l"(policy));
  return policy;
}
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src, bool valid,
                                           uint64_t l2_policy) {
  asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2, %3;\n" ::"r"(dst),
               "l"(src), "r"(valid ? 16 : 0), "l"(l2_policy));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
__device__ __forceinline__ void ldsm_x4(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t addr, uint32_t (&r)[4]) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

template <typename T> struct Elem;
template <> struct Elem<__half> {
  __device__ static void mma(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  __device__ static uint32_t pack(float lo, float hi) {
    __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  }
  __device__ static __half from_float(float x) { return __float2half_rn(x); }
  __device__ static float to_float(__half x) { return __half2float(x); }
};
template <> struct Elem<__nv_bfloat16> {
  __device__ static void mma(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  __device__ static uint32_t pack(float lo, float hi) {
    __nv_bfloat162 h = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
  }
  __device__ static __nv_bfloat16 from_float(float x) { return __float2bfloat16_rn(x); }
  __device__ static float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
};

// One warp's online-softmax state over the tile's 16 rows; a lane holds rows g = lane / 4 and
// g + 8: O in the m16n8 accumulator layout (columns 8n + 2t, +1 with t = lane % 4), the running
// maxima in log2 units, and per-lane partial sums (the row's 4 lanes add up in merge_warps).
template <int D> struct WarpState {
  float o[D / 8][4];
  float m_lo, m_hi, l_lo, l_hi;
};

// One step of a warp's online softmax: QK^T over N16 16-token K tiles at `slot`, then PV over
// the N16 V tiles after them (each 16 rows of D elements, swizzled), P kept in registers as
// PV's A operand. Scores of tokens at or past `limit` are masked; `first_tok` is the step's
// first token. Every step holds at least one token below `limit`, so the new maxima are finite.
template <typename T, int D, int N16>
__device__ __forceinline__ void attend_step(WarpState<D>& st, const uint32_t (&qa)[D / 16][4],
                                            const uint8_t* slot, int first_tok, int limit,
                                            float scale_log2) {
  constexpr int ROW_BYTES = D * 2, TILE_BYTES = 16 * ROW_BYTES;
  const int lane = threadIdx.x & 31, t = lane & 3;
  const int mat = lane >> 3, mrow = lane & 7;  // the ldmatrix 8×8 this lane addresses
  float s[2 * N16][4];
#pragma unroll
  for (int n = 0; n < 2 * N16; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
  for (int j = 0; j < N16; ++j) {
    const uint32_t k_tile = smem_u32(slot + j * TILE_BYTES);
#pragma unroll
    for (int ks = 0; ks < D / 16; ++ks) {
      uint32_t kb[4];  // tokens 0-7 / 8-15 of the tile, head dims 16ks..16ks+15
      ldsm_x4(k_tile + swizzle<ROW_BYTES>(mrow + (mat >> 1) * 8, 2 * ks + (mat & 1)), kb);
      Elem<T>::mma(s[2 * j], qa[ks], kb[0], kb[1]);
      Elem<T>::mma(s[2 * j + 1], qa[ks], kb[2], kb[3]);
    }
  }
  const bool tail = first_tok + N16 * 16 > limit;
  float max_lo = -INFINITY, max_hi = -INFINITY;
#pragma unroll
  for (int n = 0; n < 2 * N16; ++n) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const bool masked = tail && first_tok + n * 8 + 2 * t + (e & 1) >= limit;
      s[n][e] = masked ? -INFINITY : s[n][e] * scale_log2;
    }
    max_lo = fmaxf(max_lo, fmaxf(s[n][0], s[n][1]));
    max_hi = fmaxf(max_hi, fmaxf(s[n][2], s[n][3]));
  }
#pragma unroll
  for (int x = 1; x <= 2; x <<= 1) {  // a row's 16·N16 scores sit in its 4 lanes
    max_lo = fmaxf(max_lo, __shfl_xor_sync(0xffffffffu, max_lo, x));
    max_hi = fmaxf(max_hi, __shfl_xor_sync(0xffffffffu, max_hi, x));
  }
  const float new_lo = fmaxf(st.m_lo, max_lo), new_hi = fmaxf(st.m_hi, max_hi);
  const float alpha_lo = exp2f(st.m_lo - new_lo), alpha_hi = exp2f(st.m_hi - new_hi);
  st.m_lo = new_lo;
  st.m_hi = new_hi;
  uint32_t pa[N16][4];  // P as the A fragments of PV, one k16 step per tile
  float sum_lo = 0.f, sum_hi = 0.f;
#pragma unroll
  for (int n = 0; n < 2 * N16; ++n) {
    const float p0 = exp2f(s[n][0] - new_lo), p1 = exp2f(s[n][1] - new_lo);
    const float p2 = exp2f(s[n][2] - new_hi), p3 = exp2f(s[n][3] - new_hi);
    sum_lo += p0 + p1;
    sum_hi += p2 + p3;
    pa[n >> 1][(n & 1) * 2] = Elem<T>::pack(p0, p1);
    pa[n >> 1][(n & 1) * 2 + 1] = Elem<T>::pack(p2, p3);
  }
  st.l_lo = st.l_lo * alpha_lo + sum_lo;
  st.l_hi = st.l_hi * alpha_hi + sum_hi;
#pragma unroll
  for (int n = 0; n < D / 8; ++n) {
    st.o[n][0] *= alpha_lo; st.o[n][1] *= alpha_lo;
    st.o[n][2] *= alpha_hi; st.o[n][3] *= alpha_hi;
  }
#pragma unroll
  for (int j = 0; j < N16; ++j) {
    const uint32_t v_tile = smem_u32(slot + (N16 + j) * TILE_BYTES);
#pragma unroll
    for (int dp = 0; dp < D / 16; ++dp) {
      uint32_t vb[4];  // tokens 0-7 / 8-15, head dims 16dp..16dp+7 / 16dp+8..16dp+15
      ldsm_x4_trans(v_tile + swizzle<ROW_BYTES>(mrow + (mat & 1) * 8, 2 * dp + (mat >> 1)), vb);
      Elem<T>::mma(st.o[2 * dp], pa[j], vb[0], vb[1]);
      Elem<T>::mma(st.o[2 * dp + 1], pa[j], vb[2], vb[3]);
    }
  }
}

// The merged rows' maximum and sum, as a segment's partial needs them.
struct RowStats {
  float m_lo, m_hi, l_lo, l_hi;
};

// The NW warps' states combined in the mma layout, through `scratch` (shared memory the rings
// no longer need: 2·NW·16 floats + (NW − 1)·(D / 8) float4 a lane). Warps 1.. leave m, l and O
// there and return false; warp 0 gets O = Σ_w exp2(m_w − m)·O_w / l (0 in a row no warp saw a
// token of) and the rows' merged m and l, and returns true. The work per thread does not grow
// with the query group (a pass over (row, dim) did: 2 % of the paged kernel at group 4,
// notes/triton.md, Session 25). Every thread of the CTA must call it.
template <int D, int NW>
__device__ __forceinline__ bool merge_warps(WarpState<D>& st, float* scratch, RowStats& rows) {
  constexpr int NT = D / 8;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, g = lane >> 2, t = lane & 3;
#pragma unroll
  for (int x = 1; x <= 2; x <<= 1) {
    st.l_lo += __shfl_xor_sync(0xffffffffu, st.l_lo, x);
    st.l_hi += __shfl_xor_sync(0xffffffffu, st.l_hi, x);
  }
  cp_wait<0>();
  __syncthreads();  // every warp is past its ring
  float* ms = scratch;                                   // [NW][16]
  float* ls = ms + NW * 16;                              // [NW][16]
  float4* os = reinterpret_cast<float4*>(ls + NW * 16);  // [NW − 1][NT][32 lanes]
  if (warp > 0) {
    if (t == 0) {
      ms[warp * 16 + g] = st.m_lo; ms[warp * 16 + g + 8] = st.m_hi;
      ls[warp * 16 + g] = st.l_lo; ls[warp * 16 + g + 8] = st.l_hi;
    }
#pragma unroll
    for (int n = 0; n < NT; ++n)
      os[((warp - 1) * NT + n) * 32 + lane] =
          make_float4(st.o[n][0], st.o[n][1], st.o[n][2], st.o[n][3]);
  }
  __syncthreads();
  if (warp > 0) return false;
  float top_lo = st.m_lo, top_hi = st.m_hi;
#pragma unroll
  for (int w = 1; w < NW; ++w) {
    top_lo = fmaxf(top_lo, ms[w * 16 + g]);
    top_hi = fmaxf(top_hi, ms[w * 16 + g + 8]);
  }
  // A warp that saw no token of a row (l = 0) weighs 0; a NaN l (a non-finite input) weighs
  // NaN, so the row comes out NaN rather than zeros.
  auto weight = [](float l_w, float m_w, float m) { return l_w == 0.f ? 0.f : exp2f(m_w - m); };
  float w_lo[NW], w_hi[NW];
  w_lo[0] = weight(st.l_lo, st.m_lo, top_lo);
  w_hi[0] = weight(st.l_hi, st.m_hi, top_hi);
  float sum_lo = st.l_lo * w_lo[0], sum_hi = st.l_hi * w_hi[0];
#pragma unroll
  for (int w = 1; w < NW; ++w) {
    w_lo[w] = weight(ls[w * 16 + g], ms[w * 16 + g], top_lo);
    w_hi[w] = weight(ls[w * 16 + g + 8], ms[w * 16 + g + 8], top_hi);
    sum_lo += ls[w * 16 + g] * w_lo[w];
    sum_hi += ls[w * 16 + g + 8] * w_hi[w];
  }
  const float inv_lo = sum_lo != 0.f ? 1.f / sum_lo : 0.f;
  const float inv_hi = sum_hi != 0.f ? 1.f / sum_hi : 0.f;
#pragma unroll
  for (int w = 0; w < NW; ++w) {
    w_lo[w] *= inv_lo;
    w_hi[w] *= inv_hi;
  }
#pragma unroll
  for (int n = 0; n < NT; ++n) {
    st.o[n][0] *= w_lo[0]; st.o[n][1] *= w_lo[0]; st.o[n][2] *= w_hi[0]; st.o[n][3] *= w_hi[0];
#pragma unroll
    for (int w = 1; w < NW; ++w) {
      const float4 x = os[((w - 1) * NT + n) * 32 + lane];
      st.o[n][0] += x.x * w_lo[w]; st.o[n][1] += x.y * w_lo[w];
      st.o[n][2] += x.z * w_hi[w]; st.o[n][3] += x.w * w_hi[w];
    }
  }
  rows = RowStats{top_lo, top_hi, sum_lo, sum_hi};
  return true;
}

}  // namespace ws_lab
