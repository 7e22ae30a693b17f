// Codes an fp32 weight as q8 or q4 panels (cpu_kernels/panels.h) where every weight decodes back to its own bits, checked
// by decoding each block with the kernel's own weights_at (cpu_kernels/panel_codes.py picks the candidate scales).
#include <math.h>
#include <string.h>

#include "panel_decode.h"

// one output's codes in a block: q = round((w - offset) / scale), clamped to the format's range (half to even, as
// torch rounds)
template <int F>
static void encode(const float* w, float scale, float offset, uint8_t* block, int o) {
  for (int k = 0; k < QB; ++k) {
    float q = scale == 0.0f ? 0.0f : nearbyintf((w[k] - offset) / scale);
    if (F == Q8) {
      q = q < -128.0f ? -128.0f : q > 127.0f ? 127.0f : q;
      ((int8_t*)(block + P * 4))[k * P + o] = (int8_t)q;
    } else {
      q = q < 0.0f ? 0.0f : q > 15.0f ? 15.0f : q;
      uint8_t* byte = block + 2 * P * 4 + k * P / 2 + o / 16 * 8 + o % 8;  // cpu_kernels/panels.h's Q4 layout
      const int shift = o / 8 % 2 * 4;
      *byte = (uint8_t)((*byte & ~(0xF << shift)) | ((int)q << shift));
    }
  }
}

// a scale or offset the kernel reads as written: finite, and zero or normal (flush-denormal mode reads a subnormal
// as zero)
static bool plain(float v) { return isfinite(v) && (v == 0.0f || fabsf(v) >= 1.17549435e-38f); }

// which of the block's P outputs decode back to their weights' bits (bit o for output o); x: output 0's first weight
template <int F>
static uint32_t decodes_back(const uint8_t* block, const float* x, int64_t in) {
  uint32_t wrong = 0;
  for (int k = 0; k < QB; ++k) {
    __m256 v[4];
    float got[P];
    weights_at<F>(block, k, v);
    for (int c = 0; c < 4; ++c) _mm256_storeu_ps(got + 8 * c, v[c]);
    for (int o = 0; o < P; ++o) wrong |= (uint32_t)(memcmp(&got[o], &x[o * in + k], 4) != 0) << o;
  }
  return ~wrong;
}

// w [out][in] (out a multiple of P, in of QB); scales [candidates][out][in / QB], offsets [out][in / QB] (q4) or
// null; dst [out / P][in / QB][block bytes]. Each output of a block takes the first candidate it decodes back with.
// Returns 0 where every block was coded, else 1 (dst then partial)
template <int F>
static int64_t code(const float* w, int64_t out, int64_t in, const float* scales, int64_t candidates,
                    const float* offsets, uint8_t* dst) {
  const int64_t blocks = in / QB;
  for (int64_t p = 0; p < out / P; ++p)
    for (int64_t j = 0; j < blocks; ++j) {
      uint8_t* block = dst + (p * blocks + j) * block_bytes(F);
      const float* x = w + p * P * in + j * QB;
      float* scale = (float*)block;
      memset(block, 0, block_bytes(F));
      uint32_t pending = 0xFFFFFFFFu;
      for (int64_t c = 0; c < candidates && pending; ++c) {
        uint32_t tried = 0;
        for (int o = 0; o < P; ++o) {
          const int64_t at = (p * P + o) * blocks + j;
          const float s = scales[c * out * blocks + at], m = offsets ? offsets[at] : 0.0f;
          if (!(pending >> o & 1) || !plain(s) || !plain(m)) continue;
          scale[o] = s;
          if (F == Q4) scale[P + o] = m;
          encode<F>(x + o * in, s, m, block, o);
          tried |= 1u << o;
        }
        pending &= ~(tried & decodes_back<F>(block, x, in));
      }
      if (pending) return 1;
    }
  return 0;
}

extern "C" int64_t code_panels(const float* w, int64_t out, int64_t in, int64_t format, const float* scales,
                               int64_t candidates, const float* offsets, uint8_t* dst) {
  if (format == Q8) return code<Q8>(w, out, in, scales, candidates, nullptr, dst);
  if (format == Q4) return code<Q4>(w, out, in, scales, candidates, offsets, dst);
  return 1;
}
