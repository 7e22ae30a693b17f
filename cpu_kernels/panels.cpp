// y[r, j] = sum_k x[r, k] * w[j, k] (+ bias[j]) in fp32, the weight packed in panels of P outputs (cpu_kernels/panels.h).
// Each output is one FMA chain over k = 0 .. in-1 in order, started at zero, in whichever tile it falls: a row's
// bits do not depend on how many rows the call holds or where the row sits among them (cpu_kernels/panels.py). A coded
// panel (bf16, q8, q4) is decoded k-block by k-block into fp32 first, to the weight's own bits, and the same chains
// run over the decoded block: every format gives the same products, from fewer bytes.
#include <immintrin.h>
#include <stdint.h>

#include <vector>

#include "panel_decode.h"
#include "panels.h"

static inline void store(__m256 acc, const float* bias, float* y, int c, int valid) {
  float out[8];
  _mm256_storeu_ps(out, acc);
  for (int i = 0; i < 8 && c + i < valid; ++i) y[c + i] = bias ? out[i] + bias[c + i] : out[i];
}

// R rows (up to 6) x 16 outputs from panel column c: 2R chains, a compute-bound tile for prefill rows past the
// first two. Its two passes over a panel read every other 64 bytes: from memory that halves the
// stream's pace, so it reads a panel the two-row pass has just brought into cache
template <int R>
static void tall(const float* x, int64_t in, const float* w, int c, const float* bias, float* y, int64_t out,
                 int valid) {
  __m256 a0 = _mm256_setzero_ps(), b0 = a0, a1 = a0, b1 = a0, a2 = a0, b2 = a0, a3 = a0, b3 = a0, a4 = a0, b4 = a0,
         a5 = a0, b5 = a0;
  w += c;
  for (int64_t k = 0; k < in; ++k, w += P) {
    __m256 w0 = _mm256_loadu_ps(w), w1 = _mm256_loadu_ps(w + 8), xk;
#define ROW(r)                                \
  if (R > r) {                                \
    xk = _mm256_broadcast_ss(x + r * in + k); \
    a##r = _mm256_fmadd_ps(xk, w0, a##r);     \
    b##r = _mm256_fmadd_ps(xk, w1, b##r);     \
  }
    ROW(0) ROW(1) ROW(2) ROW(3) ROW(4) ROW(5)
#undef ROW
  }
#define OUT(r)                                                                                   \
  if (R > r) {                                                                                   \
    store(a##r, bias, y + r * out, c, valid), store(b##r, bias, y + r * out, c + 8, valid);      \
  }
  OUT(0) OUT(1) OUT(2) OUT(3) OUT(4) OUT(5)
#undef OUT
}

template <int R>
static void tall_panel(const float* x, int64_t in, const float* w, const float* bias, float* y, int64_t out,
                       int valid) {
  tall<R>(x, in, w, 0, bias, y, out, valid);
  tall<R>(x, in, w, 16, bias, y, out, valid);
}

// rows x the panel's 32 outputs from their accumulators, 4 per row
static void store_rows(const __m256* acc, int64_t rows, const float* bias, float* y, int64_t out, int valid) {
  for (int64_t r = 0; r < rows; ++r)
    for (int c = 0; c < 4; ++c) store(acc[r * 4 + c], bias, y + r * out, c * 8, valid);
}

enum { KB = 64, G = 16 };  // k-block of KB inputs; verify rows up to G

// R rows (1 or 2) x the whole panel over n inputs, from x's and w's k-block start, its 4R chains carried in acc
// between blocks. The first pair of a block fetches the panel's next block into cache, `step` bytes an input (ahead
// null: none), so memory streams while the pairs compute from L1 (an fp32 panel) or from its decoded copy (coded)
template <int R>
static void wide_block(const float* x, int64_t in, const float* w, int64_t n, __m256* acc, const char* ahead = nullptr,
                       int64_t step = 0) {
  __m256 a0 = acc[0], a1 = acc[1], a2 = acc[2], a3 = acc[3], b0 = a0, b1 = a0, b2 = a0, b3 = a0;
  if (R > 1) b0 = acc[4], b1 = acc[5], b2 = acc[6], b3 = acc[7];
  for (int64_t k = 0; k < n; ++k, w += P) {
    if (ahead) {
      _mm_prefetch(ahead + k * step, _MM_HINT_T0);
      if (step > 64) _mm_prefetch(ahead + k * step + 64, _MM_HINT_T0);  // fp32: two lines an input
    }
    __m256 w0 = _mm256_loadu_ps(w), w1 = _mm256_loadu_ps(w + 8), w2 = _mm256_loadu_ps(w + 16),
           w3 = _mm256_loadu_ps(w + 24);
    __m256 xk = _mm256_broadcast_ss(x + k);
    a0 = _mm256_fmadd_ps(xk, w0, a0);
    a1 = _mm256_fmadd_ps(xk, w1, a1);
    a2 = _mm256_fmadd_ps(xk, w2, a2);
    a3 = _mm256_fmadd_ps(xk, w3, a3);
    if (R > 1) {
      xk = _mm256_broadcast_ss(x + in + k);
      b0 = _mm256_fmadd_ps(xk, w0, b0);
      b1 = _mm256_fmadd_ps(xk, w1, b1);
      b2 = _mm256_fmadd_ps(xk, w2, b2);
      b3 = _mm256_fmadd_ps(xk, w3, b3);
    }
  }
  acc[0] = a0, acc[1] = a1, acc[2] = a2, acc[3] = a3;
  if (R > 1) acc[4] = b0, acc[5] = b1, acc[6] = b2, acc[7] = b3;
}

// R rows (1 or 2) x the whole panel: 4R chains, enough to stream a decode step's weights at the memory's pace
template <int R>
static void wide(const float* x, int64_t in, const float* w, const float* bias, float* y, int64_t out, int valid) {
  __m256 acc[8];
  for (int i = 0; i < 4 * R; ++i) acc[i] = _mm256_setzero_ps();
  wide_block<R>(x, in, w, in, acc);
  store_rows(acc, R, bias, y, out, valid);
}

// inputs [k0, k0 + n) of a coded panel decoded into fp32 [n][P] (k0 a whole number of blocks)
template <int F>
static void decode(const uint8_t* panel, int64_t k0, int64_t n, float* out) {
  for (const uint8_t* block = panel + k0 / QB * block_bytes(F); n > 0; n -= QB, block += block_bytes(F))
    for (int k = 0; k < QB && k < n; ++k, out += P) {
      __m256 w[4];
      weights_at<F>(block, k, w);
      for (int c = 0; c < 4; ++c) _mm256_storeu_ps(out + 8 * c, w[c]);
    }
}

static void decode(const uint8_t* panel, int64_t format, int64_t k0, int64_t n, float* out) {
  format == BF16 ? decode<BF16>(panel, k0, n, out) : format == Q8 ? decode<Q8>(panel, k0, n, out)
                                                                  : decode<Q4>(panel, k0, n, out);
}

// R rows (1 or 2) x a whole coded panel, each input's weights decoded in registers and used at once
template <int R, int F>
static void coded_wide(const float* x, int64_t in, const uint8_t* panel, const float* bias, float* y, int64_t out,
                       int valid) {
  __m256 a[4] = {_mm256_setzero_ps(), a[0], a[0], a[0]}, b[4] = {a[0], a[0], a[0], a[0]};
  const uint8_t* block = panel;
  for (int64_t k0 = 0; k0 < in; k0 += QB, block += block_bytes(F)) {
    _mm_prefetch((const char*)(block + 4 * block_bytes(F)), _MM_HINT_T0);
    for (int k = 0; k < QB && k0 + k < in; ++k) {
      __m256 w[4];
      weights_at<F>(block, k, w);
      __m256 xk = _mm256_broadcast_ss(x + k0 + k);
      for (int c = 0; c < 4; ++c) a[c] = _mm256_fmadd_ps(xk, w[c], a[c]);
      if (R > 1) {
        xk = _mm256_broadcast_ss(x + in + k0 + k);
        for (int c = 0; c < 4; ++c) b[c] = _mm256_fmadd_ps(xk, w[c], b[c]);
      }
    }
  }
  __m256 acc[8] = {a[0], a[1], a[2], a[3], b[0], b[1], b[2], b[3]};
  store_rows(acc, R, bias, y, out, valid);
}

// rows (1 to G) x the panel in one pass over it: each k-block serves every pair of rows in turn, read in place from
// an fp32 panel (rows past two; 1 or 2 take wide) or decoded into L1 from a coded one
static void blocked_rows(const float* x, int64_t rows, int64_t in, const uint8_t* panel, int64_t format,
                         const float* bias, float* y, int64_t out, int valid) {
  __m256 acc[G * 4];
  alignas(32) float decoded[KB * P];
  for (int64_t i = 0; i < rows * 4; ++i) acc[i] = _mm256_setzero_ps();
  const int64_t block = KB / QB * block_bytes((int)format), step = block / KB;  // bytes of KB inputs; of one
  for (int64_t k0 = 0; k0 < in; k0 += KB) {
    const int64_t n = k0 + KB < in ? KB : in - k0;
    const uint8_t* at = panel + k0 / QB * block_bytes((int)format);
    const float* w = (const float*)at;
    if (format != F32) decode(panel, format, k0, n, decoded), w = decoded;
    int64_t r = 0;
    for (; r + 2 <= rows; r += 2)
      wide_block<2>(x + r * in + k0, in, w, n, acc + r * 4, r == 0 ? (const char*)(at + block) : nullptr, step);
    if (r < rows) wide_block<1>(x + r * in + k0, in, w, n, acc + r * 4);
  }
  store_rows(acc, rows, bias, y, out, valid);
}

// rows x an fp32 panel
static void panel_rows(const float* x, int64_t rows, int64_t in, const float* w, const float* bias, float* y,
                       int64_t out, int valid) {
  if (rows < 3) return rows == 2 ? wide<2>(x, in, w, bias, y, out, valid)
                                 : rows == 1 ? wide<1>(x, in, w, bias, y, out, valid) : void();
  if (rows <= G) return blocked_rows(x, rows, in, (const uint8_t*)w, F32, bias, y, out, valid);
  wide<2>(x, in, w, bias, y, out, valid);
  int64_t r = 2;
  for (; r + 6 <= rows; r += 6) tall_panel<6>(x + r * in, in, w, bias, y + r * out, out, valid);
  x += r * in, y += r * out;
  switch (rows - r) {
    case 1: wide<1>(x, in, w, bias, y, out, valid); break;
    case 2: wide<2>(x, in, w, bias, y, out, valid); break;
    case 3: tall_panel<3>(x, in, w, bias, y, out, valid); break;
    case 4: tall_panel<4>(x, in, w, bias, y, out, valid); break;
    case 5: tall_panel<5>(x, in, w, bias, y, out, valid); break;
    default: break;
  }
}

static void coded_wide_rows(const float* x, int64_t rows, int64_t in, const uint8_t* panel, int64_t format,
                            const float* bias, float* y, int64_t out, int valid) {
  if (rows == 2) {
    format == BF16 ? coded_wide<2, BF16>(x, in, panel, bias, y, out, valid)
    : format == Q8 ? coded_wide<2, Q8>(x, in, panel, bias, y, out, valid)
                   : coded_wide<2, Q4>(x, in, panel, bias, y, out, valid);
  } else if (rows == 1) {
    format == BF16 ? coded_wide<1, BF16>(x, in, panel, bias, y, out, valid)
    : format == Q8 ? coded_wide<1, Q8>(x, in, panel, bias, y, out, valid)
                   : coded_wide<1, Q4>(x, in, panel, bias, y, out, valid);
  }
}

static int64_t panel_bytes(int64_t format, int64_t in) {
  switch (format) {
    case BF16: return in * P * 2;
    case Q8: return in / QB * Q8_BYTES;
    case Q4: return in / QB * Q4_BYTES;
    default: return in * P * 4;
  }
}

// One panel per thread at a time: no output is split between threads, so the thread count changes no bits. A coded
// panel under more than G rows (a prefill, compute-bound) is decoded whole into the thread's scratch first.
extern "C" void panel_linear(const float* x, int64_t rows, int64_t in, const void* w, int64_t format, int64_t out,
                             const float* bias, float* y) {
  const int64_t panels = (out + P - 1) / P, bytes = panel_bytes(format, in);
  const bool whole = format != F32 && rows > G;
#pragma omp parallel
  {
    std::vector<float> scratch(whole ? in * P : 0);
#pragma omp for schedule(static)
    for (int64_t p = 0; p < panels; ++p) {
      const int valid = (int)(out - p * P < P ? out - p * P : P);
      const uint8_t* panel = (const uint8_t*)w + p * bytes;
      const float *b = bias ? bias + p * P : nullptr;
      if (format == F32) {
        panel_rows(x, rows, in, (const float*)panel, b, y + p * P, out, valid);
      } else if (whole) {
        decode(panel, format, 0, in, scratch.data());
        panel_rows(x, rows, in, scratch.data(), b, y + p * P, out, valid);
      } else if (rows > 2) {
        blocked_rows(x, rows, in, panel, format, b, y + p * P, out, valid);
      } else {
        coded_wide_rows(x, rows, in, panel, format, b, y + p * P, out, valid);
      }
    }
  }
}
