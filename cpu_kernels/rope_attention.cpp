// One fp32 attention step for n query rows of a batch-1 Llama layer, from its fused qkv rows: rope on q and k (after
// their per-head norms, Qwen3's), k and v written to the cache at slots start .. start+n-1, then each (row, head)
// attends over the cache slots it may see.
// A row reads its visible slots in slot order, one at a time, whatever else the call holds: its bits are the same
// decoded alone, verified among k rows or prefilled (cpu_kernels/rope_attention.py).
#include <math.h>
#include <stdint.h>
#include <string.h>

#include "rope_attention.h"

#include "vec.h"

#include <vector>

// rotate-half rope (HF's layout): out = x * cos + cat(-x2, x1) * sin
static void rope(const float* x, const float* cos, const float* sin, int64_t d, float* out) {
  const int64_t half = d / 2;
  for (int64_t i = 0; i < half; ++i) out[i] = x[i] * cos[i] - x[i + half] * sin[i];
  for (int64_t i = half; i < d; ++i) out[i] = x[i] * cos[i] + x[i - half] * sin[i];
}

// A row's heads that read the same keys (a GQA group's) are taken N at a time, up to GROUP: each key and value is
// loaded once for all N. Every head's sums are still its own, taken in the same order, so its bits do not change.
enum { GROUP = 3 };

// out_t[c .. c+8w) = sum over visible j, in slot order, of e_t[j] * v[j][c .. c+8w), for N heads: head t's weights at
// e + t * stride, its output at out + t * d
template <int N, int W>
static void weighted_sums(const float* e, int64_t stride, const float* v, int64_t d, int64_t c, int64_t end,
                          const uint8_t* seen, float* out) {
  __m256 acc[N][W];
  for (int t = 0; t < N; ++t)
    for (int w = 0; w < W; ++w) acc[t][w] = _mm256_setzero_ps();
  for (int64_t j = 0; j < end; ++j) {
    if (seen && !seen[j]) continue;
    const float* vj = v + j * d + c;
    for (int w = 0; w < W; ++w) {
      const __m256 vw = _mm256_loadu_ps(vj + 8 * w);
      for (int t = 0; t < N; ++t) acc[t][w] = _mm256_fmadd_ps(_mm256_set1_ps(e[t * stride + j]), vw, acc[t][w]);
    }
  }
  for (int t = 0; t < N; ++t)
    for (int w = 0; w < W; ++w) _mm256_storeu_ps(out + t * d + c + 8 * w, acc[t][w]);
}

// N heads' dot products with four keys at once (independent chains for the pipeline); each is computed as dot()
// would: head t's scores for keys j .. j+3 go to e[t * stride + j ..]
template <int N>
static inline void dots4(const float* q, const float* k, int64_t d, float* e, int64_t stride, int64_t j) {
  if (d % 8) {
    for (int t = 0; t < N; ++t)
      for (int u = 0; u < 4; ++u) e[t * stride + j + u] = dot(q + t * d, k + u * d, d);
    return;
  }
  __m256 acc[N][4];
  for (int t = 0; t < N; ++t)
    for (int u = 0; u < 4; ++u) acc[t][u] = _mm256_setzero_ps();
  for (int64_t i = 0; i < d; i += 8) {
    __m256 qi[N];
    for (int t = 0; t < N; ++t) qi[t] = _mm256_loadu_ps(q + t * d + i);
    for (int u = 0; u < 4; ++u) {
      const __m256 ku = _mm256_loadu_ps(k + u * d + i);
      for (int t = 0; t < N; ++t) acc[t][u] = _mm256_fmadd_ps(qi[t], ku, acc[t][u]);
    }
  }
  for (int t = 0; t < N; ++t)
    for (int u = 0; u < 4; ++u) e[t * stride + j + u] = hsum(acc[t][u]);
}

// Scores of the visible slots below end turned into softmax weights (unnormalised, shifted by their max); returns
// their total, or 0 where the row may see nothing. e holds end rounded up to 8 floats.
static float softmax_weights(float* e, int64_t end, const uint8_t* seen, float scale) {
  float top = -INFINITY;
  bool any = false;
  for (int64_t j = 0; j < end; ++j) {
    e[j] *= scale;
    if (seen && !seen[j]) continue;
    any = true;
    top = e[j] > top ? e[j] : top;
  }
  if (!any) return 0.0f;
  for (int64_t j = end; j % 8; ++j) e[j] = top;  // padding: exp8 reads whole lanes
  const __m256 top8 = _mm256_set1_ps(top);
  for (int64_t j = 0; j < end; j += 8) _mm256_storeu_ps(e + j, exp8(_mm256_sub_ps(_mm256_loadu_ps(e + j), top8)));
  float total = 0.0f;
  for (int64_t j = 0; j < end; ++j)
    if (!seen || seen[j]) total += e[j];
  return total;
}

// N heads of one query row (consecutive, q [N][d], out [N][d]) that read the same keys and see the same slots:
// softmax(q k^T * scale) v over the visible slots (those below end that seen marks, or all below end), each sum taken
// in slot order. e holds N rows of stride floats (end rounded up to 8).
template <int N>
static void attend_heads(const float* q, const float* k, const float* v, int64_t d, int64_t end, const uint8_t* seen,
                         float scale, float* e, int64_t stride, float* out) {
  int64_t j = 0;
  for (; j + 4 <= end; j += 4) dots4<N>(q, k + j * d, d, e, stride, j);
  for (; j < end; ++j)
    for (int t = 0; t < N; ++t) e[t * stride + j] = dot(q + t * d, k + j * d, d);
  float total[N];
  for (int t = 0; t < N; ++t) total[t] = softmax_weights(e + t * stride, end, seen, scale);
  if (total[0] == 0.0f) {  // rows that may see nothing attend to nothing: zeros, as torch's SDPA gives
    for (int64_t i = 0; i < N * d; ++i) out[i] = 0.0f;
    return;
  }
  int64_t c = 0;
  for (; c + 32 <= d; c += 32) weighted_sums<N, 4>(e, stride, v, d, c, end, seen, out);
  for (; c + 8 <= d; c += 8) weighted_sums<N, 1>(e, stride, v, d, c, end, seen, out);
  for (; c < d; ++c) {
    for (int t = 0; t < N; ++t) {
      float acc = 0.0f;
      for (j = 0; j < end; ++j)
        if (!seen || seen[j]) acc += e[t * stride + j] * v[j * d + c];
      out[t * d + c] = acc;
    }
  }
  for (int t = 0; t < N; ++t) {
    const float inv = 1.0f / total[t];
    for (int64_t i = 0; i < d; ++i) out[t * d + i] *= inv;
  }
}

// A q or k head as rope reads it: itself, or (Qwen3) RMSNormed over its d features by w into `into`
static inline const float* head(const float* x, int64_t d, const float* w, float eps, float* into) {
  if (!w) return x;
  rms_row(x, d, w, eps, into);
  return into;
}

// operands as cpu_kernels/rope_attention.h says
extern "C" void rope_attention(const float* qkv, int64_t n, int64_t h, int64_t kv, int64_t d, const float* cos,
                               const float* sin, float* k_cache, float* v_cache, int64_t max_len, int64_t start,
                               const uint8_t* mask, int64_t cols, const QKNorm* norm, float* out) {
  const int64_t width = (h + 2 * kv) * d, group = h / kv;
  const int64_t slots = mask ? cols : start + n;
  const float *qw = norm ? norm->q : nullptr, *kw = norm ? norm->k : nullptr;
  const float eps = norm ? norm->eps : 0.0f;
  std::vector<float> q(n * h * d), normed(norm ? d : 0);
  for (int64_t r = 0; r < n; ++r) {
    const float *row = qkv + r * width, *c = cos + r * d, *s = sin + r * d;
    for (int64_t hd = 0; hd < h; ++hd)
      rope(head(row + hd * d, d, qw, eps, normed.data()), c, s, d, q.data() + (r * h + hd) * d);
    for (int64_t g = 0; g < kv; ++g) {
      rope(head(row + (h + g) * d, d, kw, eps, normed.data()), c, s, d, k_cache + (g * max_len + start + r) * d);
      memcpy(v_cache + (g * max_len + start + r) * d, row + (h + kv + g) * d, d * sizeof(float));
    }
  }
  const float scale = 1.0f / sqrtf((float)d);
  const int64_t chunks = (group + GROUP - 1) / GROUP, stride = (slots + 7) / 8 * 8;
#pragma omp parallel
  {
    std::vector<float> scores(GROUP * stride);
#pragma omp for schedule(static, 1)  // round robin: a causal prefill's late rows read the most slots
    for (int64_t p = 0; p < n * kv * chunks; ++p) {
      const int64_t r = p / (kv * chunks), g = p / chunks % kv, skip = p % chunks * GROUP, first = g * group + skip;
      const int64_t heads = group - skip < GROUP ? group - skip : GROUP;  // the group's heads from `first`, up to 3
      const uint8_t* seen = mask ? mask + r * cols : nullptr;
      int64_t end = mask ? cols : start + r + 1;
      while (seen && end > 0 && !seen[end - 1]) --end;  // a causal row's future slots are not read
      if (seen && !memchr(seen, 0, end)) seen = nullptr;  // every slot below end visible (a chain): no per-slot test
      const float *qp = q.data() + (r * h + first) * d, *kg = k_cache + g * max_len * d, *vg = v_cache + g * max_len * d;
      float* o = out + (r * h + first) * d;
      switch (heads) {
        case 3: attend_heads<3>(qp, kg, vg, d, end, seen, scale, scores.data(), stride, o); break;
        case 2: attend_heads<2>(qp, kg, vg, d, end, seen, scale, scores.data(), stride, o); break;
        default: attend_heads<1>(qp, kg, vg, d, end, seen, scale, scores.data(), stride, o); break;
      }
    }
  }
}
