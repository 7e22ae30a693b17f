// Decoding a coded panel's weights to fp32, input by input: shared by the kernel (cpu_kernels/panels.cpp) and the coder
// that checks each block decodes back exactly (cpu_kernels/panel_codes.cpp).
#pragma once
#include <immintrin.h>
#include <stdint.h>

#include "panels.h"

enum { P = 32, QB = 32, Q8_BYTES = P * 4 + QB * P, Q4_BYTES = 2 * P * 4 + QB * P / 2 };

// bytes of one block of QB inputs of a panel
static constexpr int64_t block_bytes(int F) {
  return F == Q8 ? Q8_BYTES : F == Q4 ? Q4_BYTES : QB * P * (F == BF16 ? 2 : 4);
}

// the fp32 weights of a coded block's input k, its P outputs in 4 vectors: bf16 widened, q * scale, and
// q * scale + offset as one FMA. cpu_kernels/panel_codes.cpp codes a block only where every weight comes back from this
// very arithmetic with its own bits
template <int F>
static inline void weights_at(const uint8_t* block, int k, __m256* w) {
  const float* scale = (const float*)block;
  if (F == BF16) {
    const __m128i* s = (const __m128i*)(block + k * P * 2);
    for (int c = 0; c < 4; ++c)
      w[c] = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(s + c)), 16));
  } else if (F == Q8) {
    const int8_t* row = (const int8_t*)(block + P * 4) + k * P;
    for (int c = 0; c < 4; ++c) {
      __m256 q = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)(row + 8 * c))));
      w[c] = _mm256_mul_ps(q, _mm256_loadu_ps(scale + 8 * c));
    }
  } else {
    // byte i of a half holds its outputs i (low nibble) and 8 + i (high): two widenings give all four vectors
    const __m256i low = _mm256_set1_epi32(0x0F);
    const uint8_t* row = block + 2 * P * 4 + k * P / 2;
    const __m256i a = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)row)),
                  b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(row + 8)));
    const __m256i q[4] = {_mm256_and_si256(a, low), _mm256_srli_epi32(a, 4), _mm256_and_si256(b, low),
                          _mm256_srli_epi32(b, 4)};
    for (int c = 0; c < 4; ++c)
      w[c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(q[c]), _mm256_loadu_ps(scale + 8 * c), _mm256_loadu_ps(scale + P + 8 * c));
  }
}

