// EAGLE-3's draft forward in one call (cpu_kernels/eagle3_draft.py): the target outputs kept since the last draft
// projected by fc into the head's feature store, the midlayer over the new slots, and the last slot's logits over the
// draft vocabulary. The same kernels, in the same order, as the head's modules run them one by one, so the bits are
// the same; what goes is the Python between them, which costs a one-level draft more than its weights' bytes.
#include <string.h>

#include "decoder_layer.h"

extern "C" void rms_norm(const float* x, int64_t rows, int64_t dim, const float* w, float eps, float* out);
extern "C" void eagle3_layer(const float* embeds, const float* feature, int64_t n, const LayerWeights* w,
                             const float* hidden_norm, const Step* s, float* k_cache, float* v_cache, float* work,
                             float* out);

// cpu_kernels/eagle3_draft.py's HEAD, field for field
struct Eagle3Head {
  LayerWeights layer;
  const float* hidden_norm;
  Panels fc;
  int64_t fc_in;       // the tapped target layers' widths, end to end
  const float* norm;   // the norm before lm_head
  float norm_eps;
  Panels lm_head;
  int64_t vocab;       // the draft vocabulary
  const float* embed;  // the target's embedding [embed_rows][hidden], borrowed
  int64_t embed_rows;
};

// floats per row of work: the embeddings, then the midlayer's own; or the taps' rows end to end, where wider
extern "C" int64_t eagle3_draft_work(const Eagle3Head* h) {
  const int64_t layer = h->layer.hidden + eagle3_work(&h->layer);
  return layer > h->fc_in ? layer : h->fc_in;
}

// taps: fc_in / hidden tensors [m][hidden] (the target's tapped layers), end to end a row fc reads -> projected
// [m][hidden] (the store's rows; m may be 0); then slots of tokens [n] reading features [n][hidden] (the store's rows,
// the projected ones among them) through the midlayer into out [n][hidden]; logits [vocab] of out's last row. work
// holds max(m, n) rows. Returns -1, or the index of the first token past the embedding (then nothing is run)
extern "C" int64_t eagle3_draft(const Eagle3Head* h, const float* const* taps, int64_t m, float* projected,
                             const int64_t* tokens, const float* features, int64_t n, const Step* s, float* k_cache,
                             float* v_cache, float* work, float* out, float* logits) {
  const int64_t H = h->layer.hidden;
  for (int64_t r = 0; r < n; ++r)
    if (tokens[r] < 0 || tokens[r] >= h->embed_rows) return r;
  if (m) {  // the taps' rows end to end into work, then fc
    float* row = work;
    for (int64_t r = 0; r < m; ++r)
      for (int64_t j = 0; j < h->fc_in / H; ++j, row += H) memcpy(row, taps[j] + r * H, H * sizeof(float));
    panel_linear(work, m, h->fc_in, h->fc.data, h->fc.format, H, nullptr, projected);
  }
  float *embeds = work, *rest = work + n * H;
  for (int64_t r = 0; r < n; ++r) memcpy(embeds + r * H, h->embed + tokens[r] * H, H * sizeof(float));
  eagle3_layer(embeds, features, n, &h->layer, h->hidden_norm, s, k_cache, v_cache, rest, out);
  float* normed = embeds;  // the embeddings are read: their first row holds the last one's norm
  rms_norm(out + (n - 1) * H, 1, H, h->norm, h->norm_eps, normed);
  panel_linear(normed, 1, H, h->lm_head.data, h->lm_head.format, h->vocab, nullptr, logits);
  return -1;
}
