// Raw-CUDA paged decode attention (benchmark comparison only): bf16, head_dim 128, GQA group
// G in {1, 2, 4, 8}, split-K with the same partial layout as kernels/decode_attention.py so its
// Triton reduction kernel merges the splits.
//
// Grid (num_seqs, num_kv_heads, num_splits), 128 threads. A half-warp owns one token at a time:
// each of its 16 lanes loads 16 bytes (8 bf16) of K and V, so a token's 256-byte row is one
// coalesced access; UNROLL tokens are loaded before the first use to keep loads in flight.
// Each half-warp keeps its own online-softmax state; the 8 states merge in shared memory.
#include <cuda_bf16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

namespace {

constexpr int kHeadDim = 128;
constexpr int kVec = 8;                              // bf16 per 16-byte load
constexpr int kLanesPerToken = kHeadDim / kVec;      // 16
constexpr int kTokensPerWarp = 32 / kLanesPerToken;  // 2
constexpr int kWarps = 4;
constexpr int kStates = kWarps * kTokensPerWarp;  // 8 independent softmax states
constexpr int kUnroll = 4;

struct Params {
  const __nv_bfloat16* q;        // [S, H, D]
  const __nv_bfloat16* k_cache;  // [NB, BS, KVH, D]
  const __nv_bfloat16* v_cache;  // [NB, BS, KVH, D]
  const int32_t* block_tables;   // [S, MB]
  const int32_t* context_lens;   // [S]
  __nv_bfloat16* out;            // [S, H, D]
  float* part_out;               // [S, H, P, D]
  float* part_lse;               // [S, H, P]
  float qk_scale_log2;
  int num_heads;
  int block_size;
  int max_blocks;
  int num_splits;
  int64_t stride_kb;
  int64_t stride_ks;
  int64_t stride_kh;
};

__device__ inline void to_float8(const uint4& raw, float* f) {
  const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&raw);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    float2 v = __bfloat1622float2(h[i]);
    f[2 * i] = v.x;
    f[2 * i + 1] = v.y;
  }
}

template <int G>
__device__ void merge_and_store(const Params& p, float (*m)[G], float (*l)[G], float* acc_smem,
                                int seq, int kv_head, int split) {
  for (int idx = threadIdx.x; idx < G * kHeadDim; idx += blockDim.x) {
    const int g = idx / kHeadDim, d = idx % kHeadDim;
    float m_max = -INFINITY;
    for (int s = 0; s < kStates; ++s) m_max = fmaxf(m_max, m[s][g]);
    float denom = 0.f, num = 0.f;
    if (m_max != -INFINITY) {
      for (int s = 0; s < kStates; ++s) {
        const float w = (m[s][g] == -INFINITY) ? 0.f : exp2f(m[s][g] - m_max);
        denom += l[s][g] * w;
        num += acc_smem[(s * G + g) * kHeadDim + d] * w;
      }
    }
    const float o = denom > 0.f ? num / denom : 0.f;
    const int head = kv_head * G + g;
    const int64_t row = static_cast<int64_t>(seq) * p.num_heads + head;
    if (p.num_splits == 1) {
      p.out[row * kHeadDim + d] = __float2bfloat16(o);
    } else {
      const int64_t prow = row * p.num_splits + split;
      p.part_out[prow * kHeadDim + d] = o;
      if (d == 0) p.part_lse[prow] = denom > 0.f ? m_max + log2f(denom) : -INFINITY;
    }
  }
}

template <int G>
__global__ void __launch_bounds__(kWarps * 32) paged_decode_kernel(Params p) {
  const int seq = blockIdx.x, kv_head = blockIdx.y, split = blockIdx.z;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int sub = lane / kLanesPerToken, l16 = lane % kLanesPerToken;
  const int state = warp * kTokensPerWarp + sub;
  const int ctx = p.context_lens[seq];
  const int per_split = ((ctx + p.num_splits - 1) / p.num_splits + 63) / 64 * 64;
  const int start = split * per_split;
  const int end = min(start + per_split, ctx);

  float q[G][kVec];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    const int64_t off =
        (static_cast<int64_t>(seq) * p.num_heads + kv_head * G + g) * kHeadDim + l16 * kVec;
    to_float8(*reinterpret_cast<const uint4*>(p.q + off), q[g]);
#pragma unroll
    for (int e = 0; e < kVec; ++e) q[g][e] *= p.qk_scale_log2;
  }
  float m[G], l[G], acc[G][kVec];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    m[g] = -INFINITY;
    l[g] = 0.f;
#pragma unroll
    for (int e = 0; e < kVec; ++e) acc[g][e] = 0.f;
  }
  const int32_t* table = p.block_tables + static_cast<int64_t>(seq) * p.max_blocks;
  constexpr int kStep = kWarps * kTokensPerWarp * kUnroll;
  for (int base = start + warp * kTokensPerWarp * kUnroll; base < end; base += kStep) {
    uint4 kraw[kUnroll], vraw[kUnroll];
    bool valid[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int t = base + u * kTokensPerWarp + sub;
      valid[u] = t < end;
      if (valid[u]) {
        const int64_t blk = table[t / p.block_size];
        const int64_t off = blk * p.stride_kb + (t % p.block_size) * p.stride_ks +
                            kv_head * p.stride_kh + l16 * kVec;
        kraw[u] = __ldg(reinterpret_cast<const uint4*>(p.k_cache + off));
        vraw[u] = __ldg(reinterpret_cast<const uint4*>(p.v_cache + off));
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      float kf[kVec], vf[kVec], s[G];
      if (valid[u]) to_float8(kraw[u], kf);
#pragma unroll
      for (int g = 0; g < G; ++g) {
        float dot = 0.f;
#pragma unroll
        for (int e = 0; e < kVec; ++e) dot += valid[u] ? q[g][e] * kf[e] : 0.f;
#pragma unroll
        for (int o = kLanesPerToken / 2; o > 0; o >>= 1)
          dot += __shfl_xor_sync(0xffffffffu, dot, o);
        s[g] = dot;
      }
      if (!valid[u]) continue;  // uniform within the half-warp, after the shuffles
      to_float8(vraw[u], vf);
#pragma unroll
      for (int g = 0; g < G; ++g) {
        const float m_new = fmaxf(m[g], s[g]);
        const float alpha = exp2f(m[g] - m_new);
        const float pr = exp2f(s[g] - m_new);
        l[g] = l[g] * alpha + pr;
#pragma unroll
        for (int e = 0; e < kVec; ++e) acc[g][e] = acc[g][e] * alpha + pr * vf[e];
        m[g] = m_new;
      }
    }
  }
  __shared__ float m_smem[kStates][G];
  __shared__ float l_smem[kStates][G];
  __shared__ float acc_smem[kStates * G * kHeadDim];
#pragma unroll
  for (int g = 0; g < G; ++g) {
    if (l16 == 0) {
      m_smem[state][g] = m[g];
      l_smem[state][g] = l[g];
    }
#pragma unroll
    for (int e = 0; e < kVec; ++e)
      acc_smem[(state * G + g) * kHeadDim + l16 * kVec + e] = acc[g][e];
  }
  __syncthreads();
  merge_and_store<G>(p, m_smem, l_smem, acc_smem, seq, kv_head, split);
}

}  // namespace

extern "C" int pagedinfer_cuda_decode(const void* q, const void* k_cache, const void* v_cache,
                                      const int32_t* block_tables, const int32_t* context_lens,
                                      void* out, float* part_out, float* part_lse,
                                      float qk_scale_log2, int num_seqs, int num_heads,
                                      int num_kv_heads, int block_size, int max_blocks,
                                      int num_splits, int64_t stride_kb, int64_t stride_ks,
                                      int64_t stride_kh, cudaStream_t stream) {
  Params p{static_cast<const __nv_bfloat16*>(q),
           static_cast<const __nv_bfloat16*>(k_cache),
           static_cast<const __nv_bfloat16*>(v_cache),
           block_tables,
           context_lens,
           static_cast<__nv_bfloat16*>(out),
           part_out,
           part_lse,
           qk_scale_log2,
           num_heads,
           block_size,
           max_blocks,
           num_splits,
           stride_kb,
           stride_ks,
           stride_kh};
  const dim3 grid(num_seqs, num_kv_heads, num_splits);
  const dim3 block(kWarps * 32);
  switch (num_heads / num_kv_heads) {
    case 1:
      paged_decode_kernel<1><<<grid, block, 0, stream>>>(p);
      break;
    case 2:
      paged_decode_kernel<2><<<grid, block, 0, stream>>>(p);
      break;
    case 4:
      paged_decode_kernel<4><<<grid, block, 0, stream>>>(p);
      break;
    case 8:
      paged_decode_kernel<8><<<grid, block, 0, stream>>>(p);
      break;
    default:
      return -1;
  }
  return static_cast<int>(cudaGetLastError());
}
