// Fused decode attention in CUDA C++ on static caches (B, Hkv, Lmax, D): RoPE on q and the new k,
// the cache write at each sequence's position, and attention over [0, position], one launch.
// Built and launched by fused_decode_cuda.py; kernels/decode/fused_decode.py's ``_launch`` dispatches
// here where ``fused_decode_cuda.applies`` holds (the rollout's Qwen2.5-0.5B shape among them).
//
// Counterpart: the Triton kernel it replaces there (kernels/decode/fused_decode.py), with the warp
// structure of this lab's paged_cuda.cu (FlashAttention-2's split-KV decode, FlashInfer's GQA
// tile: a KV head's query group as the 16 rows of one mma tile).
//
// Grid (KV head, sequence), NW warps a CTA, no segments: B·Hkv fills the GPU where it applies.
//   - Prologue: griddepcontrol.wait (PDL: the grid launched while q|k|v's GEMM drained), the
//     position; then one 16-byte load a thread of q's rows, the new k and v, and the cos / sin
//     rows (NewToken), issued *before* the ring's loads: issued after them, they
//     queued behind the context's ~64 KB a CTA and the prologue took 3.8 µs, against ~0.3
//     issued first (256 ns timer stamps in the rollout's step, notes/rollout.md, Session 26).
//     Then q's rows rotated into shared memory (rotate-half in fp32, rounded to T, rows past
//     the group zero), the rotated k and v written to the cache at the position. One CTA
//     barrier.
//   - Main loop: each warp owns a cp.async ring of STAGES slots; a slot holds CPS 16-token
//     chunks of K and of V (contiguous rows), loaded with an L2 evict_first policy. Every slot
//     is filled before the loop (a context of ≤ NW·STAGES chunks, 384 tokens at 8 × 3, is
//     asked for at once; −3 µs a rollout step against STAGES − 1, Session 27), and a slot is
//     refilled once its chunk is consumed. The warps walk the context's chunks round-robin,
//     each with its own online-softmax state: no CTA barrier. Rows at and past the position are
//     zero-filled by cp.async (nothing read) and masked; no program reads the slot it writes.
//     Warp 0 opens its state with the new token from registers (m = its score, l = 1, O = v).
//   - QK^T and PV: mma.sync m16n8k16, P kept in registers as PV's A operand; K/V chunks
//     XOR-swizzled per 16-byte piece so ldmatrix (K) and ldmatrix.trans (V) are conflict-free.
//   - Dependents launch after the main loop; the warps then merge in the mma fragment layout
//     (warps 1.. leave m, l, O in shared memory, warp 0 combines and writes its group's rows).
// Shared memory (D 64, 8 warps, 3 slots of 1 chunk): 2 KB q + 0.5 KB new k/v + 96 KB ring.
// Registers: 108 a thread on sm_90, no spills (tests/cpu/test_fused_decode_cuda.py pins them).
#include "cuda_common.cuh"

namespace {
using namespace ws_lab;
constexpr int CHUNK = 16;  // cache tokens per chunk: the n of two m16n8k16 tiles

template <typename T> struct Params {
  const T* q; const T* k_new; const T* v_new; T* k_cache; T* v_cache; const T* cos;
  const T* sin; const int* positions; T* out;
  float scale_log2; int group; int capacity;
  long long stride_qb, stride_knb, stride_vnb;
};

// 16 bytes from global memory, as an asm volatile load: it stays ahead of the cp.async ring
// loads issued after it (the compiler may sink a plain load past them).
__device__ __forceinline__ uint4 load16(const void* p) {
  uint4 v;
  asm volatile("ld.global.v4.u32 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

// The prologue's inputs, one 16-byte piece a thread: threads [0, 16·D/8) take piece (row, p) of
// q's 16 rows (rows past the group load nothing and store zeros), the next D/8 the new k's
// pieces, the D/8 after them the new v's. RoPE is rotate-half: piece p's partner is p ± D/16.
template <typename T, int D> struct NewToken {
  static constexpr int CH16 = D / 8, Q_PIECES = 16 * CH16, THREADS = Q_PIECES + 2 * CH16;
  static constexpr int ROW_BYTES = 2 * D;
  uint4 x, partner, cos, sin;
  bool is_q, is_k, live;
  int row, p;

  __device__ __forceinline__ void load(const Params<T>& a, int b, int kvh, int pos) {
    const int idx = threadIdx.x;
    is_q = idx < Q_PIECES;
    is_k = !is_q && idx < Q_PIECES + CH16;
    row = is_q ? idx / CH16 : 0;
    p = is_q ? idx % CH16 : (idx - Q_PIECES) % CH16;
    live = idx < THREADS && (!is_q || row < a.group);
    x = partner = cos = sin = make_uint4(0, 0, 0, 0);
    if (!live) return;
    const T* src = is_q ? a.q + b * a.stride_qb + (long long)(kvh * a.group + row) * D
                 : is_k ? a.k_new + b * a.stride_knb + (long long)kvh * D
                        : a.v_new + b * a.stride_vnb + (long long)kvh * D;
    x = load16(src + p * 8);
    if (is_q || is_k) {
      partner = load16(src + ((p + CH16 / 2) % CH16) * 8);
      cos = load16(a.cos + (long long)pos * D + p * 8);
      sin = load16(a.sin + (long long)pos * D + p * 8);
    }
  }

  // q's piece (rotated, or zero past the group) into its swizzled slot of `qs`; the new k's
  // (rotated) and v's into the cache at `pos` and, as rounded to T, into k_new_s / v_new_s.
  __device__ __forceinline__ void store(uint8_t* qs, T* k_row, T* v_row, float* k_new_s,
                                        float* v_new_s, bool write_cache) const {
    if (threadIdx.x >= THREADS) return;
    const T* xs = reinterpret_cast<const T*>(&x);
    const T* ps = reinterpret_cast<const T*>(&partner);
    const T* cs = reinterpret_cast<const T*>(&cos);
    const T* ss = reinterpret_cast<const T*>(&sin);
    const float sign = p < CH16 / 2 ? -1.f : 1.f;
    uint4 out;
    T* o = reinterpret_cast<T*>(&out);
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      const float v = Elem<T>::to_float(xs[e]);
      o[e] = Elem<T>::from_float(is_q || is_k ? v * Elem<T>::to_float(cs[e]) +
                                                    sign * Elem<T>::to_float(ps[e]) *
                                                        Elem<T>::to_float(ss[e])
                                              : v);
    }
    if (is_q) {
      *reinterpret_cast<uint4*>(qs + swizzle<ROW_BYTES>(row, p)) = out;
      return;
    }
    if (write_cache) *reinterpret_cast<uint4*>((is_k ? k_row : v_row) + p * 8) = out;
    float* dst = (is_k ? k_new_s : v_new_s) + p * 8;
#pragma unroll
    for (int e = 0; e < 8; ++e) dst[e] = Elem<T>::to_float(o[e]);
  }
};

template <typename T, int D, int NW, int STAGES, int CPS>
__device__ __forceinline__ void fused(const Params<T>& a) {
  constexpr int ROW_BYTES = D * 2, CHUNK_BYTES = CHUNK * ROW_BYTES;
  constexpr int SLOT = CPS * 2 * CHUNK_BYTES;  // one step: CPS chunks of K, then of V
  constexpr int CH16 = D / 8;                  // 16-byte pieces of a row
  constexpr int KS = D / 16, NT = D / 8;
  constexpr int Q_BYTES = 16 * ROW_BYTES;
  static_assert(NewToken<T, D>::THREADS <= NW * 32, "a thread a piece of q, k_new, v_new");
  extern __shared__ __align__(128) uint8_t smem[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int kvh = blockIdx.x, b = blockIdx.y, kv_heads = gridDim.x;
  const int g = lane >> 2, t = lane & 3;
  const long long rows0 = ((long long)b * kv_heads + kvh) * a.capacity * D;
  T* k_rows = a.k_cache + rows0;
  T* v_rows = a.v_cache + rows0;

  uint8_t* qs = smem;
  float* k_new_s = reinterpret_cast<float*>(smem + Q_BYTES);  // [D] as rounded to T
  float* v_new_s = k_new_s + D;
  uint8_t* ring = smem + Q_BYTES + 2 * D * 4 + warp * STAGES * SLOT;
#if __CUDA_ARCH__ >= 900
  // Nothing before the wait: an L2 prefetch of the context there cost the rollout's step 11 µs,
  // and these loads issued early (the position read before its writer is known to be done)
  // gained 2 µs, inside the rounds' spread (notes/rollout.md, Session 25).
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
  // A position outside [0, capacity) writes nothing and its rows come out NaN (warp 0's l,
  // below); the kernel reads as if at the clamped position, inside every buffer: the addressing
  // of the clamp before the boundary (notes/fused_decode.md, "Session 35").
  const int wanted = a.positions[b];
  const int pos = min(max(wanted, 0), a.capacity - 1);
  const bool pos_ok = pos == wanted;
  const int n_steps = (pos + CPS * CHUNK - 1) / (CPS * CHUNK);
  const int my_steps = n_steps > warp ? (n_steps - warp + NW - 1) / NW : 0;
  // The context is read once a step: evict_first keeps it from pushing the weights that the
  // side stream's prefetch put in L2 for the GEMMs after this kernel (−3 to −5 µs a rollout
  // step, notes/rollout.md, Session 27).
  const uint64_t read_once = l2_evict_first_policy();
  auto issue = [&](int step) {
    if (step < my_steps) {
      uint8_t* slot = ring + (step % STAGES) * SLOT;
#pragma unroll
      for (int j = 0; j < CPS; ++j) {
        const int tok0 = ((warp + NW * step) * CPS + j) * CHUNK;
        const uint32_t k_dst = smem_u32(slot + j * CHUNK_BYTES);
        const uint32_t v_dst = smem_u32(slot + (CPS + j) * CHUNK_BYTES);
#pragma unroll
        for (int i = 0; i < CHUNK * CH16 / 32; ++i) {
          const int idx = lane + 32 * i, row = idx / CH16, piece = idx % CH16;
          const bool valid = tok0 + row < pos;
          const long long off = valid ? (long long)(tok0 + row) * D + piece * 8 : 0;
          cp_async16(k_dst + swizzle<ROW_BYTES>(row, piece), k_rows + off, valid, read_once);
          cp_async16(v_dst + swizzle<ROW_BYTES>(row, piece), v_rows + off, valid, read_once);
        }
      }
    }
    cp_commit();
  };
  NewToken<T, D> token;
  token.load(a, b, kvh, pos);  // ahead of the ring's loads
#pragma unroll
  for (int s = 0; s < STAGES; ++s) issue(s);  // every slot: a whole context of ≤ NW·STAGES chunks

  token.store(qs, k_rows + (long long)pos * D, v_rows + (long long)pos * D, k_new_s, v_new_s,
              pos_ok);
  __syncthreads();

  const int mat = lane >> 3, mrow = lane & 7;  // the ldmatrix 8×8 this lane addresses
  uint32_t qa[KS][4];
#pragma unroll
  for (int ks = 0; ks < KS; ++ks)
    ldsm_x4(smem_u32(qs) + swizzle<ROW_BYTES>(mrow + (mat & 1) * 8, 2 * ks + (mat >> 1)), qa[ks]);

  WarpState<D> st;
  st.m_lo = st.m_hi = -INFINITY;
  st.l_lo = st.l_hi = 0.f;
  if (warp == 0) {  // the new token opens warp 0's state: m = its score, l = 1, O = its value
    float s_lo = 0.f, s_hi = 0.f;
    for (int d = t; d < D; d += 4) {
      const float k = k_new_s[d];
      s_lo += Elem<T>::to_float(*reinterpret_cast<const T*>(
                  qs + swizzle<ROW_BYTES>(g, d / 8) + (d % 8) * 2)) * k;
      s_hi += Elem<T>::to_float(*reinterpret_cast<const T*>(
                  qs + swizzle<ROW_BYTES>(g + 8, d / 8) + (d % 8) * 2)) * k;
    }
#pragma unroll
    for (int x = 1; x <= 2; x <<= 1) {
      s_lo += __shfl_xor_sync(0xffffffffu, s_lo, x);
      s_hi += __shfl_xor_sync(0xffffffffu, s_hi, x);
    }
    st.m_lo = s_lo * a.scale_log2;
    st.m_hi = s_hi * a.scale_log2;
    // per-lane partial sums, added up over the row's lanes; NaN for a position out of range
    st.l_lo = st.l_hi = t == 0 ? (pos_ok ? 1.f : NAN) : 0.f;
#pragma unroll
    for (int n = 0; n < NT; ++n) {
      st.o[n][0] = st.o[n][2] = v_new_s[8 * n + 2 * t];
      st.o[n][1] = st.o[n][3] = v_new_s[8 * n + 2 * t + 1];
    }
  } else {
#pragma unroll
    for (int n = 0; n < NT; ++n) st.o[n][0] = st.o[n][1] = st.o[n][2] = st.o[n][3] = 0.f;
  }

  for (int step = 0; step < my_steps; ++step) {
    cp_wait<STAGES - 1>();
    __syncwarp();
    const int first_tok = (warp + NW * step) * CPS * CHUNK;
    attend_step<T, D, CPS>(st, qa, ring + (step % STAGES) * SLOT, first_tok, pos, a.scale_log2);
    __syncwarp();  // every lane is done with the slot before it is refilled
    issue(step + STAGES);
  }
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
  // The warps meet in shared memory past q and the new k / v; warp 0 writes the group's rows.
  RowStats rows;
  if (!merge_warps<D, NW>(st, reinterpret_cast<float*>(smem + Q_BYTES + 2 * D * 4), rows)) {
    return;
  }
  const int heads = kv_heads * a.group;
#pragma unroll
  for (int half = 0; half < 2; ++half) {
    const int row = g + 8 * half;
    if (row >= a.group) continue;
    T* dst = a.out + ((long long)b * heads + kvh * a.group + row) * D + 2 * t;
#pragma unroll
    for (int n = 0; n < NT; ++n)
      *reinterpret_cast<uint32_t*>(dst + 8 * n) =
          Elem<T>::pack(st.o[n][2 * half], st.o[n][2 * half + 1]);
  }
}
}  // namespace

#define FUSED(TYPE, NAME, D, NW, ST, CPS)                                                     \
  extern "C" __global__ void __launch_bounds__(NW * 32)                                      \
      fused_decode_##NAME##_##D##_##NW##_##ST##_##CPS(Params<TYPE> a) {                       \
    fused<TYPE, D, NW, ST, CPS>(a);                                                           \
  }
// The measured config (notes/rollout.md, Session 25): 8 warps, 3 slots of one chunk.
FUSED(__half, f16, 64, 8, 3, 1)
FUSED(__nv_bfloat16, bf16, 64, 8, 3, 1)
