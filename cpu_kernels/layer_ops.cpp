// The fp32 element-wise parts of a Llama layer, one call each: RMSNorm and SwiGLU's silu(gate) * up. Each row is
// computed on its own, in a fixed order, so its bits do not depend on the rows around it (cpu_kernels/layer_ops.py).
#include <math.h>
#include <stdint.h>

#include "vec.h"

// out[r] = x[r] / sqrt(mean(x[r]^2) + eps) * w, for rows of dim
extern "C" void rms_norm(const float* x, int64_t rows, int64_t dim, const float* w, float eps, float* out) {
#pragma omp parallel for schedule(static) if (rows >= 16)
  for (int64_t r = 0; r < rows; ++r) rms_row(x + r * dim, dim, w, eps, out + r * dim);
}

// out[r] = silu(h[r][:width]) * h[r][width:], for rows of 2 width (the fused gate and up projections)
extern "C" void silu_mul(const float* h, int64_t rows, int64_t width, float* out) {
#pragma omp parallel for schedule(static) if (rows >= 16)
  for (int64_t r = 0; r < rows; ++r) {
    const float *gate = h + r * 2 * width, *up = gate + width;
    float* o = out + r * width;
    int64_t i = 0;
    const __m256 one = _mm256_set1_ps(1.0f), zero = _mm256_setzero_ps();
    for (; i + 8 <= width; i += 8) {
      const __m256 g = _mm256_loadu_ps(gate + i);
      const __m256 silu = _mm256_div_ps(g, _mm256_add_ps(one, exp8(_mm256_sub_ps(zero, g))));
      _mm256_storeu_ps(o + i, _mm256_mul_ps(silu, _mm256_loadu_ps(up + i)));
    }
    for (; i < width; ++i) o[i] = gate[i] / (1.0f + expf(-gate[i])) * up[i];
  }
}
