// One fp32 attention step for n query rows of a batch-1 Llama layer, from its fused qkv rows: rope on q and k, k and v
// written to the cache at slots start .. start+n-1, then each (row, head) attends over the cache slots it may see.
// A row reads its visible slots in slot order, one at a time, whatever else the call holds: its bits are the same
// decoded alone, verified among k rows or prefilled (heads/rope_attention.py).
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "vec.h"

#include <vector>

// rotate-half rope (HF's layout): out = x * cos + cat(-x2, x1) * sin
static void rope(const float* x, const float* cos, const float* sin, int64_t d, float* out) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < half; ++i) out[i] = x[i] * cos[i] - x[i + half] * sin[i];
  for (int64_t i = half; i < d; ++i) out[i] = x[i] * cos[i] + x[i - half] * sin[i];
}

static inline float dot(const float* a, const float* b, int64_t d) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= d; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  float s = hsum(acc);
  for (; i < d; ++i) s += a[i] * b[i];
  return s;
}

// out[c .. c+8w) = sum over visible j, in slot order, of e[j] * v[j][c .. c+8w): W registers of 8 lanes
template <int W>
static void weighted_sum(const float* e, const float* v, int64_t d, int64_t c, int64_t end, const uint8_t* seen,
                         float* out) {
  __m256 acc[W];
  for (int w = 0; w < W; ++w) acc[w] = _mm256_setzero_ps();
  for (int64_t j = 0; j < end; ++j) {
    if (seen && !seen[j]) continue;
    const __m256 ej = _mm256_set1_ps(e[j]);
    const float* vj = v + j * d + c;
    for (int w = 0; w < W; ++w) acc[w] = _mm256_fmadd_ps(ej, _mm256_loadu_ps(vj + 8 * w), acc[w]);
  }
  for (int w = 0; w < W; ++w) _mm256_storeu_ps(out + c + 8 * w, acc[w]);
}

// Four keys' dot products at once (independent chains for the pipeline); each is computed as dot() would.
static inline void dot4(const float* q, const float* k, int64_t d, float* out) {
  for (int t = 0; t < 4; ++t) out[t] = 0.0f;
  if (d % 8) {
    for (int t = 0; t < 4; ++t) out[t] = dot(q, k + t * d, d);
    return;
  }
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t i = 0; i < d; i += 8) {
    const __m256 qi = _mm256_loadu_ps(q + i);
    a0 = _mm256_fmadd_ps(qi, _mm256_loadu_ps(k + i), a0);
    a1 = _mm256_fmadd_ps(qi, _mm256_loadu_ps(k + d + i), a1);
    a2 = _mm256_fmadd_ps(qi, _mm256_loadu_ps(k + 2 * d + i), a2);
    a3 = _mm256_fmadd_ps(qi, _mm256_loadu_ps(k + 3 * d + i), a3);
  }
  const __m256 acc[4] = {a0, a1, a2, a3};
  for (int t = 0; t < 4; ++t) {
    out[t] = hsum(acc[t]);
  }
}

// One query row of one head: softmax(q k^T * scale) v over the visible slots (those below end that seen marks, or
// all below end), each sum taken in slot order. e holds end rounded up to 8 floats.
static void attend_row(const float* q, const float* k, const float* v, int64_t d, int64_t end, const uint8_t* seen,
                       float scale, float* e, float* out) {
  int64_t j = 0;
  for (; j + 4 <= end; j += 4) dot4(q, k + j * d, d, e + j);
  for (; j < end; ++j) e[j] = dot(q, k + j * d, d);
  float top = -INFINITY;
  bool any = false;
  for (j = 0; j < end; ++j) {
    e[j] *= scale;
    if (seen && !seen[j]) continue;
    any = true;
    top = e[j] > top ? e[j] : top;
  }
  if (!any) {  // a row that may see nothing attends to nothing: zeros, as torch's SDPA gives
    for (int64_t i = 0; i < d; ++i) out[i] = 0.0f;
    return;
  }
  for (j = end; j % 8; ++j) e[j] = top;  // padding: exp8 reads whole lanes
  const __m256 top8 = _mm256_set1_ps(top);
  for (j = 0; j < end; j += 8) _mm256_storeu_ps(e + j, exp8(_mm256_sub_ps(_mm256_loadu_ps(e + j), top8)));
  float total = 0.0f;
  for (j = 0; j < end; ++j)
    if (!seen || seen[j]) total += e[j];
  int64_t c = 0;
  for (; c + 64 <= d; c += 64) weighted_sum<8>(e, v, d, c, end, seen, out);
  for (; c + 8 <= d; c += 8) weighted_sum<1>(e, v, d, c, end, seen, out);
  for (; c < d; ++c) {
    float acc = 0.0f;
    for (j = 0; j < end; ++j)
      if (!seen || seen[j]) acc += e[j] * v[j * d + c];
    out[c] = acc;
  }
  const float inv = 1.0f / total;
  for (int64_t i = 0; i < d; ++i) out[i] *= inv;
}

// qkv [n][(h + 2 kv) d]; cos, sin [n][d]; caches [kv][max_len][d]; mask [n][cols] (1 = may see) or null: causal,
// row r sees slots 0 .. start + r; out [n][h d].
extern "C" void rope_attention(const float* qkv, int64_t n, int64_t h, int64_t kv, int64_t d, const float* cos,
                               const float* sin, float* k_cache, float* v_cache, int64_t max_len, int64_t start,
                               const uint8_t* mask, int64_t cols, float* out) {
  const int64_t width = (h + 2 * kv) * d, group = h / kv;
  const int64_t slots = mask ? cols : start + n;
  std::vector<float> q(n * h * d);
  for (int64_t r = 0; r < n; ++r) {
    const float* row = qkv + r * width;
    for (int64_t hd = 0; hd < h; ++hd) rope(row + hd * d, cos + r * d, sin + r * d, d, q.data() + (r * h + hd) * d);
    for (int64_t g = 0; g < kv; ++g) {
      rope(row + (h + g) * d, cos + r * d, sin + r * d, d, k_cache + (g * max_len + start + r) * d);
      memcpy(v_cache + (g * max_len + start + r) * d, row + (h + kv + g) * d, d * sizeof(float));
    }
  }
  const float scale = 1.0f / sqrtf((float)d);
#pragma omp parallel
  {
    std::vector<float> scores((slots + 7) / 8 * 8);
#pragma omp for schedule(static, 1)  // round robin: a causal prefill's late rows read the most slots
    for (int64_t p = 0; p < n * h; ++p) {
      const int64_t r = p / h, hd = p % h, g = hd / group;
      const uint8_t* seen = mask ? mask + r * cols : nullptr;
      int64_t end = mask ? cols : start + r + 1;
      while (seen && end > 0 && !seen[end - 1]) --end;  // a causal row's future slots are not read
      if (seen && !memchr(seen, 0, end)) seen = nullptr;  // every slot below end visible (a chain): no per-slot test
      attend_row(q.data() + p * d, k_cache + g * max_len * d, v_cache + g * max_len * d, d, end, seen, scale,
                 scores.data(), out + r * h * d + hd * d);
    }
  }
}
