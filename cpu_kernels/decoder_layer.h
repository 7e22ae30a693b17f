// The weights and step operands a whole fp32 decoder layer reads (cpu_kernels/decoder_layer.py's LAYER and STEP, field for
// field), shared by the one-layer call (decoder_layer.cpp) and the stack of layers (decoder_stack.cpp).
#pragma once
#include <stdint.h>

#include "panels.h"
#include "rope_attention.h"

struct LayerWeights {
  const float *input_norm, *post_norm;
  Panels qkv;
  const float* qkv_bias;
  Panels o, gate_up, down;
  int64_t hidden, intermediate, heads, kv_heads, head_dim;
  float eps;
  QKNorm qk_norm;  // q and k's per-head norms (Qwen3); null weights where the layer has none
};

struct Step {
  const float *cos, *sin;
  int64_t max_len, start, cols;
  const uint8_t* mask;
};

// x [n][hidden] in, out [n][hidden]; work holds layer_work(w) floats per row
extern "C" void decoder_layer(const float* x, int64_t n, const LayerWeights* w, const Step* s, float* k_cache,
                              float* v_cache, float* work, float* out);

// floats per row of the layer past its input norm
inline int64_t after_input_work(const LayerWeights* w) {
  const int64_t qkv_width = (w->heads + 2 * w->kv_heads) * w->head_dim;
  return 3 * w->hidden + qkv_width + w->heads * w->head_dim + 3 * w->intermediate;
}

inline int64_t layer_work(const LayerWeights* w) { return w->hidden + after_input_work(w); }

// EAGLE-3's attention input is two normed halves: 2 hidden a row
inline int64_t eagle3_work(const LayerWeights* w) { return 2 * w->hidden + after_input_work(w); }
