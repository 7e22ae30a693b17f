// A model's whole stack of fp32 decoder layers for n rows of a batch-1 cached forward, in one call: each layer as
// decoder_layer runs it alone, in order, so the bits are the same; what goes is the Python between the layers
// (cpu_kernels/decoder_stack.py).
#include <string.h>

#include "decoder_layer.h"

// floats per row the stack's work needs: two residual streams and the widest layer's own work
extern "C" int64_t stack_work(const LayerWeights* layers, int64_t count) {
  int64_t widest = 0;
  for (int64_t i = 0; i < count; ++i) widest = layer_work(&layers[i]) > widest ? layer_work(&layers[i]) : widest;
  return 2 * layers[0].hidden + widest;
}

// x [n][hidden] in, out [n][hidden]; layer i writes k_caches[i], v_caches[i]; taps[i], where not null, gets a copy of
// the residual stream entering layer i (taps[count]: the last layer's output)
extern "C" void decoder_stack(const float* x, int64_t n, const LayerWeights* layers, int64_t count, const Step* s,
                              float* const* k_caches, float* const* v_caches, float* const* taps, float* work,
                              float* out) {
  const int64_t size = n * layers[0].hidden;
  float* streams[2] = {work, work + size};
  float* scratch = work + 2 * size;
  const float* in = x;
  for (int64_t i = 0; i < count; ++i) {
    if (taps[i]) memcpy(taps[i], in, size * sizeof(float));
    float* next = i == count - 1 ? out : streams[i % 2];
    decoder_layer(in, n, &layers[i], s, k_caches[i], v_caches[i], scratch, next);
    in = next;
  }
  if (taps[count]) memcpy(taps[count], in, size * sizeof(float));
}
