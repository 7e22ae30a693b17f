// A linear's weight as the panel kernel reads it (cpu_kernels/panels.py): panels of P outputs, stored in one of four
// formats that each decode to the fp32 weight bit for bit, so every format gives the same products.
#pragma once
#include <stdint.h>

enum PanelFormat {
  F32 = 0,   // [panels][in][P] fp32
  BF16 = 1,  // [panels][in][P] bf16: weights that are bf16 values
  Q8 = 2,    // [panels][in / QB] blocks: P fp32 scales, then [QB][P] int8; weight = q * scale
  Q4 = 3,    // [panels][in / QB] blocks: P fp32 scales, P fp32 offsets, then [QB][P / 2] bytes of nibbles, each
             // input's 16 bytes two halves of 8 (byte i of half h holds output 16h + i in its low nibble, 16h + 8 + i
             // in its high: two widenings decode it); weight = q * scale + offset, q * scale exact
};

struct Panels {
  const void* data;
  int64_t format;  // a PanelFormat
};

// y[rows][out] = x[rows][in] times the weight (+ bias)
extern "C" void panel_linear(const float* x, int64_t rows, int64_t in, const void* w, int64_t format, int64_t out,
                             const float* bias, float* y);
