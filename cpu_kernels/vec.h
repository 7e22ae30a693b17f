// AVX2 helpers shared by draftsmith's fp32 kernels: fixed-order reductions and a vector exp, so a value's bits depend
// only on its own inputs.
#pragma once
#include <immintrin.h>
#include <math.h>
#include <stdint.h>

// the 8 lanes summed in a fixed tree: (0+4, 1+5, 2+6, 3+7), then pairs, then the last two
static inline float hsum(__m256 acc) {
  __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s4, _mm_movehdup_ps(s4)));
}

// e^x for 8 lanes (Cephes' expf polynomial, about 1 ulp), x clamped to [-87, 88]
static inline __m256 exp8(__m256 x) {
  // max and min return their second operand when one is NaN: x second, so a NaN stays NaN
  x = _mm256_min_ps(_mm256_set1_ps(88.0f), _mm256_max_ps(_mm256_set1_ps(-87.0f), x));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  x = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(0.693359375f)));
  x = _mm256_sub_ps(x, _mm256_mul_ps(n, _mm256_set1_ps(-2.12194440e-4f)));
  __m256 y = _mm256_set1_ps(1.9875691500E-4f);
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.3981999507E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(8.3334519073E-3f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(4.1665795894E-2f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(1.6666665459E-1f));
  y = _mm256_fmadd_ps(y, x, _mm256_set1_ps(5.0000001201E-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(x, x), _mm256_add_ps(x, _mm256_set1_ps(1.0f)));
  const __m256i bits = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(bits));
}

// sum of a[i] b[i]: 8 lanes at a time, summed by hsum, then the rest in order
static inline float dot(const float* a, const float* b, int64_t d) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= d; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  float s = hsum(acc);
  for (; i < d; ++i) s += a[i] * b[i];
  return s;
}

// one RMSNorm row: o = x / sqrt(mean(x^2) + eps) * w
static inline void rms_row(const float* x, int64_t dim, const float* w, float eps, float* o) {
  const float scale = 1.0f / sqrtf(dot(x, x, dim) / (float)dim + eps);
  for (int64_t i = 0; i < dim; ++i) o[i] = x[i] * scale * w[i];
}
