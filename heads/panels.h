// A linear's weight as the panel kernel reads it (heads/panels.py): panels of P outputs, stored in one of four
// formats that each decode to the fp32 weight bit for bit, so every format gives the same products.
#pragma once
#include <stdint.h>

enum PanelFormat {
  F32 = 0,   // [panels][in][P] fp32
  BF16 = 1,  // [panels][in][P] bf16: weights that are bf16 values
  Q8 = 2,    // [panels][in / QB] blocks: P fp32 scales, then [QB][P] int8; weight = q * scale
  Q4 = 3,    // [panels][in / QB] blocks: P fp32 scales, P fp32 offsets, then [QB][P / 8] 32-bit words of nibbles
             // (word c holds outputs 8c .. 8c + 7, output 8c + i in bits 4i .. 4i + 3); weight = q * scale + offset,
             // q * scale exact
};

struct Panels {
  const void* data;
  int64_t format;  // a PanelFormat
};

// y[rows][out] = x[rows][in] times the weight (+ bias)
extern "C" void panel_linear(const float* x, int64_t rows, int64_t in, const void* w, int64_t format, int64_t out,
                             const float* bias, float* y);
