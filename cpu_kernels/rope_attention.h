// The fp32 attention step (cpu_kernels/rope_attention.cpp), as the layer kernels call it.
#pragma once
#include <stdint.h>

// Qwen3's per-head RMSNorms of q and k, applied before rope: weights of head_dim each, one eps
struct QKNorm {
  const float *q, *k;
  float eps;
};

// qkv [n][(h + 2 kv) d]; cos, sin [n][d]; caches [kv][max_len][d]; mask [n][cols] (1 = may see) or null: causal,
// row r sees slots 0 .. start + r; norm: q and k's norms, or null; out [n][h d]
extern "C" void rope_attention(const float* qkv, int64_t n, int64_t h, int64_t kv, int64_t d, const float* cos,
                               const float* sin, float* k_cache, float* v_cache, int64_t max_len, int64_t start,
                               const uint8_t* mask, int64_t cols, const QKNorm* norm, float* out);
