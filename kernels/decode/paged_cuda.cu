// Paged decode attention in CUDA C++: one query token per sequence against a paged KV cache,
// head dim 128, 16-token cache blocks, fp16 or bf16. Built and launched by paged_cuda.py.
//
// Counterpart: FlashAttention-2's split-KV decode (flash_fwd_splitkv_kernel) and vLLM's
// paged_attention v2, with FlashInfer's GQA tile (a KV head's query group as the 16 rows of
// one mma tile).
//
// Grid (segment, KV head, sequence); NW warps a CTA, no warp specialization: every warp loads
// and computes.
//   - Each warp owns a cp.async ring of STAGES slots in shared memory. A slot holds one step:
//     BPS whole cache blocks of K and of V (BPS · 8 KB). The warp walks the segment's steps
//     round-robin with the CTA's other warps (steps warp, warp + NW, ...), keeps its own
//     online-softmax state, and synchronizes only with itself (__syncwarp), so there is no
//     CTA barrier in the main loop.
//   - Before the main loop the CTA reads its segment's block ids into shared memory and orders
//     its walk by physical block id (WalkSort): the allocator scatters a sequence's blocks
//     through the pool, and when every CTA walks in address order they all sweep the pool
//     together, so the GPU reads one region of it at a time as a contiguous copy does (1-2 %
//     faster than table order, notes/triton.md, Session 30). Attention does not depend on the
//     order of full blocks; a partial last block keeps its place, where it is masked. The
//     prologue's steps keep table order, so their loads are in flight during the sort: every
//     stage where the launch left room for the sort's scratch past the walk (its table
//     reads and its serial chain then hide behind 2 steps a warp: llama7b-8k 350.0 -> 348.1
//     µs, Session 31), else all but the last, which holds the scratch. The sort's CTA
//     barriers are all before the main loop.
//   - QK^T and PV are mma.sync m16n8k16 (rows: the group's query heads, zero-padded to 16);
//     P stays in registers as PV's A operand. K and V slots are XOR-swizzled per 16-byte
//     chunk so ldmatrix (K) and ldmatrix.trans (V) are bank-conflict free.
//   - Rows past the context (the last block's tail, blocks past the segment) are zero-filled
//     by cp.async (src-size 0: nothing read) and their scores masked to -inf.
//   - After the loop the warps' (m, l, O) meet in shared memory (the rings are free by then)
//     and the CTA writes the output, or its segment's partial (m, l, O/l) when the context is
//     split; paged_merge then combines the segments.
// Shared memory: the rings, NW · STAGES · BPS · 8 KB (2,2,2: 64 KB, three CTAs an SM; 4,2,2:
// 128 KB), then the CTA's walk, 4 B a block (at most NW · MAX_WARP_SLOTS: 2,2,2 + 8 KB still
// fits three CTAs an SM), then the sort's scratch, about 8 B a block, where paged_cuda.py
// gives it room: wherever that costs no CTA an SM (2,2,2 up to 768 blocks, 12k tokens; 4,2,2
// always). The kernel reads the size it was given. Without the room the scratch is the
// rings' last stage, which the main loop fills first.
// Registers: 244 a thread on sm_90, 219 on sm_80, no spills (O: 64 fp32, Q fragments: 32;
// tests/cpu/test_paged_cuda.py pins the spills and the SASS counts).
#include <climits>

#include "cuda_common.cuh"

namespace {
using namespace ws_lab;
constexpr int D = 128;
constexpr int BS = 16;
constexpr int ROW_BYTES = D * 2;
constexpr int BLK_BYTES = BS * ROW_BYTES;  // one block's K (or V) rows for one KV head: 4 KB
// The most blocks one warp walks (the CTA sorts NW times as many); paged_cuda.plan splits
// longer contexts.
constexpr int MAX_WARP_SLOTS = 1024;
constexpr unsigned FULL_MASK = 0xffffffffu;

// The dynamic shared memory this launch was given: what paged_cuda.py asked for.
__device__ __forceinline__ int dynamic_smem_bytes() {
  unsigned bytes;
  asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(bytes));
  return static_cast<int>(bytes);
}

// The launch arguments, one struct (paged_cuda.py's ctypes mirror has the same field order).
template <typename T> struct Params {
  const T* q; const T* k_cache; const T* v_cache; const int* block_table; const int* context_lens;
  T* out; float* m_part; float* l_part; float* o_part;
  float scale_log2; int group; int max_blocks; int blocks_per_seg; int num_blocks;
  long long stride_qb, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs,
      stride_vh, stride_bt, stride_ob, stride_oh;
};

// A table entry as the walk uses it: an id outside the pool [0, num_blocks) becomes num_blocks,
// which no load reads and which poisons its row (NaN; notes/triton.md, "Session 33, later").
__device__ __forceinline__ int pool_id(int id, int num_blocks) {
  return static_cast<unsigned>(id) < static_cast<unsigned>(num_blocks) ? id : num_blocks;
}

// The CTA's walk past its prologue in ascending physical block id: ids[0, n) holds the table's
// ids (read() puts them there) and sort() leaves them in ascending order, in place. A counting
// sort over at least n power-of-two buckets spanning the ids' [min, max], then each id's rank
// inside its bucket; equal ids are interchangeable, so the order is a function of the table
// alone (the output is deterministic) however the atomics fall. Every thread of the CTA takes
// part. Thread t owns buckets [t K, t K + K) and keeps bucket t K + j's counter at j NT + t,
// so the scan reads without bank conflicts and runs one warp scan, not one per 32 buckets.
// read() goes before the prologue's cp.async, because a table read issued behind them returns
// only after their data (the sort then waits out the whole prologue, measured); sort() runs
// while that data is in flight. Scratch: by_bucket (n ints), the counters (buckets(n)), and 3
// ints a warp.
template <int NT>
struct WalkSort {
  static constexpr int NW = NT / 32, BATCH = 8;  // table reads and smem chains in flight a thread
  static constexpr int LOG_NT = NT == 64 ? 6 : NT == 128 ? 7 : -1;
  static_assert(LOG_NT > 0, "2 or 4 warps");
  int* ids;
  int* by_bucket;  // the ids, bucket by bucket
  int* count;      // per bucket: its count, then its first slot, then its end
  int* part;       // per warp: min, max, count total
  int n, lo = INT_MAX, hi = INT_MIN;

  __host__ __device__ static constexpr int log_buckets(int n) {
    int log = LOG_NT;  // at least a bucket a thread, and one an id
    while ((1 << log) < n) ++log;
    return log;
  }
  __host__ __device__ static constexpr int scratch_ints(int n) {
    return n + (1 << log_buckets(n)) + 3 * NW;
  }

  __device__ WalkSort(int* ids, int* scratch, int n)
      : ids(ids), by_bucket(scratch), count(scratch + n),
        part(scratch + n + (1 << log_buckets(n))), n(n) {}

  __device__ __forceinline__ void read(const int* table, int num_blocks) {
    for (int base = 0; base < n; base += BATCH * NT) {
      int v[BATCH];
#pragma unroll
      for (int u = 0; u < BATCH; ++u) {
        const int i = base + u * NT + threadIdx.x;
        v[u] = i < n ? pool_id(__ldg(table + i), num_blocks) : 0;
      }
#pragma unroll
      for (int u = 0; u < BATCH; ++u) {
        const int i = base + u * NT + threadIdx.x;
        if (i < n) {
          ids[i] = v[u];
          lo = min(lo, v[u]);
          hi = max(hi, v[u]);
        }
      }
    }
  }

  __device__ __forceinline__ void sort() {
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int log_b = log_buckets(n), log_k = log_b - LOG_NT, per_thread = 1 << log_k;
    for (int j = 0; j < per_thread; ++j) count[j * NT + tid] = 0;
    lo = __reduce_min_sync(FULL_MASK, lo);
    hi = __reduce_max_sync(FULL_MASK, hi);
    if (lane == 0) part[warp] = lo, part[NW + warp] = hi;
    __syncthreads();
#pragma unroll
    for (int w = 0; w < NW; ++w) lo = min(lo, part[w]), hi = max(hi, part[NW + w]);
    const unsigned span = static_cast<unsigned>(hi) - static_cast<unsigned>(lo);
    const int shift = max(0, 32 - __clz(span) - log_b);  // (span >> shift) < 2^log_b
    auto bucket = [&](int id) {
      return static_cast<int>((static_cast<unsigned>(id) - static_cast<unsigned>(lo)) >> shift);
    };
    auto counter = [&](int b) { return count + (b & (per_thread - 1)) * NT + (b >> log_k); };
    for (int i = tid; i < n; i += NT) atomicAdd(counter(bucket(ids[i])), 1);
    __syncthreads();
    // Exclusive scan: this thread's K counts, the warp's inclusive scan over them, the warps'.
    int mine = 0;
    for (int j = 0; j < per_thread; ++j) mine += count[j * NT + tid];
    int upto = mine;
#pragma unroll
    for (int d = 1; d < 32; d <<= 1) {
      const int v = __shfl_up_sync(FULL_MASK, upto, d);
      if (lane >= d) upto += v;
    }
    if (lane == 31) part[2 * NW + warp] = upto;
    __syncthreads();
    int first = upto - mine;
    for (int w = 0; w < warp; ++w) first += part[2 * NW + w];
    for (int j = 0; j < per_thread; ++j) {
      const int c = count[j * NT + tid];
      count[j * NT + tid] = first;
      first += c;
    }
    __syncthreads();
    for (int base = 0; base < n; base += BATCH * NT) {  // BATCH atomics in flight, then stores
      int id[BATCH], at[BATCH];
#pragma unroll
      for (int u = 0; u < BATCH; ++u) {
        const int i = base + u * NT + tid;
        id[u] = i < n ? ids[i] : 0;
        at[u] = i < n ? atomicAdd(counter(bucket(id[u])), 1) : -1;
      }
#pragma unroll
      for (int u = 0; u < BATCH; ++u)
        if (at[u] >= 0) by_bucket[at[u]] = id[u];
    }
    __syncthreads();  // a bucket's counter is now its end, the one before it its first slot
    for (int base = 0; base < n; base += BATCH * NT) {
      int id[BATCH], rank[BATCH];
#pragma unroll
      for (int u = 0; u < BATCH; ++u) {
        const int m = base + u * NT + tid;
        id[u] = m < n ? by_bucket[m] : lo;
        const int b = bucket(id[u]), from = b ? *counter(b - 1) : 0, last = m < n ? *counter(b) : 0;
        rank[u] = from;
        for (int r = from; r < last; ++r) {
          const int other = by_bucket[r];
          rank[u] += other < id[u] || (other == id[u] && r < m);
        }
      }
#pragma unroll
      for (int u = 0; u < BATCH; ++u)
        if (base + u * NT + tid < n) ids[rank[u]] = id[u];
    }
  }
};

template <typename T, int NW, int STAGES, int BPS>
__device__ __forceinline__ void decode(const Params<T>& a) {
  extern __shared__ __align__(128) uint8_t smem[];
  constexpr int SLOT = BPS * 2 * BLK_BYTES, RINGS = NW * STAGES * SLOT;
  using Sort = WalkSort<NW * 32>;
  static_assert(NW * SLOT >= Sort::scratch_ints(NW * MAX_WARP_SLOTS) * 4,
                "WalkSort's scratch fits the rings' last stage");
  static_assert(32 % BPS == 0, "a window of 32 slots holds whole steps");
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int seg = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
  const int n_seg = gridDim.x, kv_heads = gridDim.y;
  const int g = lane >> 2, t = lane & 3;  // mma fragment row group and column pair

  const int len = min(max(a.context_lens[b], 0), a.max_blocks * BS);
  const int blk0 = seg * a.blocks_per_seg;
  const int blk1 = min((len + BS - 1) / BS, blk0 + a.blocks_per_seg);
  const int limit = min(len, blk1 * BS);  // this segment's tokens end here
  const int n_steps = blk1 > blk0 ? (blk1 - blk0 + BPS - 1) / BPS : 0;
  const int my_steps = n_steps > warp ? (n_steps - warp + NW - 1) / NW : 0;
  auto first_block = [&](int step) { return blk0 + (warp + NW * step) * BPS; };
  // The warp's slots holding a block of the segment.
  const int n_valid = my_steps ? (my_steps - 1) * BPS + min(BPS, blk1 - first_block(my_steps - 1))
                               : 0;

  // Stage s of warp w's ring is slot s · NW + w: the last stage of every warp is one region.
  auto ring_slot = [&](int step) { return smem + ((step % STAGES) * NW + warp) * SLOT; };
  const int* table_row = a.block_table + b * a.stride_bt;
  // The CTA's walk follows the rings: position i (block blk0 + i of the segment) is warp
  // (i / BPS) % NW's slot k = (i / (BPS · NW)) · BPS + i % BPS, and its block id is order[i].
  // The sort's scratch follows the walk when the launch left room for it (paged_cuda.py does
  // where that costs no CTA an SM): then the prologue issues every stage before the sort.
  // Otherwise the scratch is the rings' last stage, which is issued after the sort. The
  // prologue's positions (the first `head` of each warp) keep table order and come straight
  // from the table, so their loads are in flight while the CTA sorts the rest.
  const int cta_slots = NW * ((a.blocks_per_seg + NW * BPS - 1) / (NW * BPS)) * BPS;
  int* order = reinterpret_cast<int*>(smem + RINGS);
  const bool sort_ahead =
      dynamic_smem_bytes() >= RINGS + 4 * (cta_slots + Sort::scratch_ints(cta_slots));
  const int head = (sort_ahead ? STAGES : STAGES - 1) * BPS, cta_head = NW * head;
  auto position = [&](int k) { return ((k / BPS) * NW + warp) * BPS + k % BPS; };
  int ids = lane < min(n_valid, head)  // 32 slots
                ? pool_id(__ldg(table_row + blk0 + position(lane)), a.num_blocks) : 0;
  // The rest of the walk is sorted by the whole CTA, the segment's partial last block in place.
  const int n_blocks = max(blk1 - blk0, 0), n_sorted = n_blocks - (limit < blk1 * BS);
  int* last_stage = reinterpret_cast<int*>(smem + (STAGES - 1) * NW * SLOT);
  Sort walk(order + cta_head, sort_ahead ? order + cta_slots : last_stage,
            max(n_sorted - cta_head, 0));
  walk.read(table_row + blk0 + cta_head, a.num_blocks);
  if (lane < min(n_valid, head)) order[position(lane)] = ids;
  int window = 0;
  bool outside = false;  // this thread met a block of the context outside the pool

  auto issue = [&](int step) {
    if (step < my_steps) {
      if (step * BPS / 32 != window) {  // slots are issued in order: 32 ids a register load
        window = step * BPS / 32;
        ids = window * 32 + lane < n_valid ? order[position(window * 32 + lane)] : 0;
      }
      uint8_t* slot = ring_slot(step);
#pragma unroll
      for (int j = 0; j < BPS; ++j) {
        const int blk = first_block(step) + j;
        const long long id = __shfl_sync(FULL_MASK, ids, (step * BPS + j) % 32);
        const bool in_pool = id < a.num_blocks;
        outside |= !in_pool && blk * BS < limit;
        const T* k_rows = a.k_cache + id * a.stride_kb + kvh * a.stride_kh;
        const T* v_rows = a.v_cache + id * a.stride_vb + kvh * a.stride_vh;
        const uint32_t k_dst = smem_u32(slot + j * BLK_BYTES);
        const uint32_t v_dst = smem_u32(slot + (BPS + j) * BLK_BYTES);
#pragma unroll
        for (int i = 0; i < 8; ++i) {  // 16 rows × 16 chunks of 16 B over 32 lanes
          const int idx = lane + 32 * i, row = idx >> 4, chunk = idx & 15;
          const bool in_context = in_pool && blk * BS + row < limit;
          cp_async16(k_dst + swizzle<ROW_BYTES>(row, chunk), k_rows + row * a.stride_ks + chunk * 8,
                     in_context);
          cp_async16(v_dst + swizzle<ROW_BYTES>(row, chunk), v_rows + row * a.stride_vs + chunk * 8,
                     in_context);
        }
      }
    }
    cp_commit();  // an empty group past the end keeps the wait count uniform
  };

  // Q as the A fragments of QK^T: row r of the tile is query head kvh · group + r.
  uint32_t qa[8][4];
  const T* q_rows = a.q + b * a.stride_qb + (long long)kvh * a.group * a.stride_qh;
#pragma unroll
  for (int ks = 0; ks < 8; ++ks) {
#pragma unroll
    for (int r = 0; r < 4; ++r) {
      const int row = g + (r & 1) * 8, col = ks * 16 + 2 * t + (r >> 1) * 8;
      qa[ks][r] = row < a.group
                      ? *reinterpret_cast<const uint32_t*>(q_rows + row * a.stride_qh + col)
                      : 0u;
    }
  }
#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) issue(s);
  if (sort_ahead) issue(STAGES - 1);
  if (walk.n > 0) walk.sort();
  if (n_sorted < n_blocks && n_sorted >= cta_head && threadIdx.x == 0)
    order[n_sorted] = pool_id(__ldg(table_row + blk0 + n_sorted), a.num_blocks);
  __syncthreads();
  ids = lane < n_valid ? order[position(lane)] : 0;
  if (!sort_ahead) issue(STAGES - 1);

  WarpState<D> st;
#pragma unroll
  for (int n = 0; n < 16; ++n) st.o[n][0] = st.o[n][1] = st.o[n][2] = st.o[n][3] = 0.f;
  st.m_lo = st.m_hi = -INFINITY;
  st.l_lo = st.l_hi = 0.f;

  for (int step = 0; step < my_steps; ++step) {
    // Issue, then attend: 0.1-1.1 % faster than attending, then refilling the slot just read
    // (notes/triton.md, Session 31, run 260).
    // After a prologue of every stage the first step has nothing to issue.
    const bool all_issued = sort_ahead && step == 0;
    if (all_issued)
      cp_wait<STAGES - 1>();
    else
      cp_wait<STAGES - 2>();
    __syncwarp();  // every lane's copies into this slot have landed; the slot issued next is free
    if (!all_issued) issue(step + STAGES - 1);
    attend_step<T, D, BPS>(st, qa, ring_slot(step), first_block(step) * BS, limit,
                           a.scale_log2);
  }

  // A block outside the pool makes the segment's rows NaN: l = NaN survives every merge.
  if (__syncthreads_or(outside)) st.l_lo = st.l_hi = NAN;
  // The warps meet in shared memory (the rings are free by then); warp 0 writes the rows.
  RowStats rows;
  if (!merge_warps<D, NW>(st, reinterpret_cast<float*>(smem), rows)) return;
  const int heads = kv_heads * a.group;
  const bool pairs = ((reinterpret_cast<uintptr_t>(a.out) | a.stride_ob | a.stride_oh) & 1) == 0;
#pragma unroll
  for (int half = 0; half < 2; ++half) {  // rows g and g + 8 of the tile
    const int row = g + 8 * half;
    if (row >= a.group) continue;
    const int h = kvh * a.group + row;
    if (n_seg == 1) {
      T* dst = a.out + b * a.stride_ob + h * a.stride_oh + 2 * t;
#pragma unroll
      for (int n = 0; n < 16; ++n) {
        const float v0 = st.o[n][2 * half], v1 = st.o[n][2 * half + 1];
        if (pairs) {
          *reinterpret_cast<uint32_t*>(dst + 8 * n) = Elem<T>::pack(v0, v1);
        } else {
          dst[8 * n] = Elem<T>::from_float(v0);
          dst[8 * n + 1] = Elem<T>::from_float(v1);
        }
      }
    } else {
      const long long p = ((long long)b * heads + h) * n_seg + seg;
      float* dst = a.o_part + p * D + 2 * t;
#pragma unroll
      for (int n = 0; n < 16; ++n)
        *reinterpret_cast<float2*>(dst + 8 * n) =
            make_float2(st.o[n][2 * half], st.o[n][2 * half + 1]);
      if (t == 0) {
        a.m_part[p] = half ? rows.m_hi : rows.m_lo;
        a.l_part[p] = half ? rows.l_hi : rows.l_lo;
      }
    }
  }
}

// The segments of one (sequence, query head) combined: grid (B · Hq), D threads.
template <typename T>
__device__ __forceinline__ void merge(const float* m_part, const float* l_part,
                                      const float* o_part, T* out, int n_seg, int heads,
                                      long long stride_ob, long long stride_oh) {
  const int bh = blockIdx.x, d = threadIdx.x;
  const float* m = m_part + (long long)bh * n_seg;
  const float* l = l_part + (long long)bh * n_seg;
  float m_max = -INFINITY;
  for (int s = 0; s < n_seg; ++s) m_max = fmaxf(m_max, m[s]);
  // An empty segment (l = 0) weighs nothing and a sequence of none gets zeros; a NaN l (a
  // non-finite input, a block outside the pool) weighs NaN, so its row stays NaN.
  float total = 0.f, acc = 0.f;
  for (int s = 0; s < n_seg; ++s) {
    const float w = l[s] == 0.f ? 0.f : l[s] * exp2f(m[s] - m_max);
    total += w;
    acc += w * o_part[((long long)bh * n_seg + s) * D + d];
  }
  out[(bh / heads) * stride_ob + (bh % heads) * stride_oh + d] =
      Elem<T>::from_float(total != 0.f ? acc / total : 0.f);
}
}  // namespace

// Exported kernels: paged_decode_<dtype>_<warps>_<stages>_<blocks per step>, paged_merge_<dtype>.
#define PAGED_DECODE(TYPE, NAME, NW, ST, BPS)                                                 \
  extern "C" __global__ void __launch_bounds__(NW * 32)                                      \
      paged_decode_##NAME##_##NW##_##ST##_##BPS(Params<TYPE> a) {                             \
    decode<TYPE, NW, ST, BPS>(a);                                                             \
  }
#define PAGED_MERGE(TYPE, NAME)                                                               \
  extern "C" __global__ void __launch_bounds__(D) paged_merge_##NAME(                        \
      const float* m_part, const float* l_part, const float* o_part, TYPE* out, int n_seg,    \
      int heads, long long stride_ob, long long stride_oh) {                                  \
    merge<TYPE>(m_part, l_part, o_part, out, n_seg, heads, stride_ob, stride_oh);            \
  }
#define PAGED_FAMILY(TYPE, NAME)                                                              \
  PAGED_DECODE(TYPE, NAME, 2, 2, 2)                                                           \
  PAGED_DECODE(TYPE, NAME, 4, 2, 2)                                                           \
  PAGED_MERGE(TYPE, NAME)
PAGED_FAMILY(__half, f16)
PAGED_FAMILY(__nv_bfloat16, bf16)
