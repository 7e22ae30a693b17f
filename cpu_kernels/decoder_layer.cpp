// A whole fp32 Llama decoder layer for n rows of a batch-1 cached forward, in one call: the same kernels, in the
// same order, as the layer's modules run them one by one (cpu_kernels/decoder_layer.py), so the bits are the same; what
// goes is the Python between them, which costs more than the layer's arithmetic besides its weights.
#include "decoder_layer.h"

extern "C" void rms_norm(const float* x, int64_t rows, int64_t dim, const float* w, float eps, float* out);
extern "C" void silu_mul(const float* h, int64_t rows, int64_t width, float* out);

static void add(const float* a, const float* b, int64_t count, float* out) {
  for (int64_t i = 0; i < count; ++i) out[i] = a[i] + b[i];
}

// floats per row a layer's work needs
extern "C" int64_t decoder_layer_work(const LayerWeights* w) { return layer_work(w); }
extern "C" int64_t eagle3_layer_work(const LayerWeights* w) { return eagle3_work(w); }

// the layer past its input norm: attention over `in` [n][width] (the normed stream, or EAGLE-3's two normed halves),
// its output added to the residual x [n][hidden], then the MLP block
static void layer_after_input(const float* in, int64_t width, const float* x, int64_t n, const LayerWeights* w,
                              const Step* s, float* k_cache, float* v_cache, float* work, float* out) {
  const int64_t H = w->hidden, I = w->intermediate, A = w->heads * w->head_dim;
  const int64_t qkv_width = (w->heads + 2 * w->kv_heads) * w->head_dim;
  float *qkv = work, *attended = qkv + n * qkv_width, *projected = attended + n * A, *mid = projected + n * H;
  float *normed = mid + n * H, *gate_up = normed + n * H, *act = gate_up + n * 2 * I;
  panel_linear(in, n, width, w->qkv.data, w->qkv.format, qkv_width, w->qkv_bias, qkv);
  rope_attention(qkv, n, w->heads, w->kv_heads, w->head_dim, s->cos, s->sin, k_cache, v_cache, s->max_len, s->start,
                 s->mask, s->cols, w->qk_norm.q ? &w->qk_norm : nullptr, attended);
  panel_linear(attended, n, A, w->o.data, w->o.format, H, nullptr, projected);
  add(x, projected, n * H, mid);
  rms_norm(mid, n, H, w->post_norm, w->eps, normed);
  panel_linear(normed, n, H, w->gate_up.data, w->gate_up.format, 2 * I, nullptr, gate_up);
  silu_mul(gate_up, n, I, act);
  panel_linear(act, n, I, w->down.data, w->down.format, H, nullptr, projected);
  add(mid, projected, n * H, out);
}

extern "C" void decoder_layer(const float* x, int64_t n, const LayerWeights* w, const Step* s, float* k_cache,
                              float* v_cache, float* work, float* out) {
  rms_norm(x, n, w->hidden, w->input_norm, w->eps, work);
  layer_after_input(work, w->hidden, x, n, w, s, k_cache, v_cache, work + n * w->hidden, out);
}

// EAGLE-3's midlayer (heads/eagle3.py): attention over [input_norm(embeds); hidden_norm(feature)] per row, the
// residual being the feature
extern "C" void eagle3_layer(const float* embeds, const float* feature, int64_t n, const LayerWeights* w,
                             const float* hidden_norm, const Step* s, float* k_cache, float* v_cache, float* work,
                             float* out) {
  const int64_t H = w->hidden;
  for (int64_t r = 0; r < n; ++r) {  // a row at a time: a norm's row gets the same bits alone or among others
    rms_norm(embeds + r * H, 1, H, w->input_norm, w->eps, work + r * 2 * H);
    rms_norm(feature + r * H, 1, H, hidden_norm, w->eps, work + r * 2 * H + H);
  }
  layer_after_input(work, 2 * H, feature, n, w, s, k_cache, v_cache, work + n * 2 * H, out);
}
