// Linear layers whose weights are kept as GGUF block codes (Q4_1, Q8_0), in float32 arithmetic.
//
// A GGUF checkpoint stores each run of 32 input values of one output row as small integer codes
// with float16 scales: Q4_1 as w = d * q + m (q in 0..15), Q8_0 as w = q * d (q in -128..127).
// Dequantised once to float32, such a model reads 4 bytes per weight each decode step; kept as
// codes it reads 0.625 (Q4_1) or 1.0625 (Q8_0). This op computes out = x @ W^T from the codes,
// rebuilding each float32 weight in registers exactly as GGUF's own dequantisation does (a float
// multiply, then a float add: the build turns off contraction into fused multiply-adds, so the
// bits are the same), so the layer is the float32 layer, not an approximation of it.
//
// Packed layout (`gguf_blocks.py` writes it): output columns in tiles of 16 (one AVX-512
// vector), each tile's K in blocks of 32, stored tile-major:
//
//     tile t, block b at (t * K/32 + b) * bytes_per_block
//     Q4_1 (320 bytes): d[16] f16, m[16] f16, then 16 pairs of k: byte j of pair p holds
//                       column j's code for k = 2p (low nibble) and k = 2p + 1 (high nibble)
//     Q8_0 (544 bytes): d[16] f16, then 32 rows of k: column j's int8 code at byte j
//
// One summation order for every row, whatever the batch: each output is
//
//     acc = 0;  for k in 0 .. K-1:  acc = fma(x[k], w[k], acc)
//
// so a sequence's logits have the same bits alone or among 4,000 other rows, and on 1 thread
// or many (work is split over output columns only, never over K). A call of up to 6 rows (a
// decode step) decodes each weight into a register and uses it there (`rows_times_codes`).
// A longer one has each thread decode a group of up to 4 tiles for the whole K into a panel
// [K][64] of floats (at most 384 KiB for K = 1,536), then multiply every row of x against it,
// 6 rows at a time, so the codes are decoded once per call however many rows there are. Both
// paths build the same weights and add them in the same order: the same bits.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>
#include <immintrin.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace {

constexpr int64_t kTile = 16;         // output columns per tile: one vector of floats
constexpr int64_t kBlock = 32;        // input values per GGUF block
constexpr int kGroupTiles = 4;        // tiles a thread decodes into one panel
constexpr int kRowsPerPass = 6;       // rows of x multiplied against the panel at once
constexpr int64_t kFormatQ4_1 = 1;
constexpr int64_t kFormatQ8_0 = 2;

int64_t bytes_per_block(int64_t format) { return format == kFormatQ4_1 ? 320 : 544; }

inline __m512 halves(const uint8_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

inline __m128i sixteen_bytes(const uint8_t* p) {
  return _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
}

// Writes one block's 32 x 16 weights to rows k = 0..31 of a panel with `stride` floats per row.
void decode_q4_1(const uint8_t* block, float* panel, int64_t stride) {
  const __m512 d = halves(block);
  const __m512 m = halves(block + 32);
  const __m512i low_nibble = _mm512_set1_epi32(15);
  for (int pair = 0; pair < kBlock / 2; ++pair) {
    const __m512i codes = _mm512_cvtepu8_epi32(sixteen_bytes(block + 64 + 16 * pair));
    const __m512 q_even = _mm512_cvtepi32_ps(_mm512_and_si512(codes, low_nibble));
    const __m512 q_odd = _mm512_cvtepi32_ps(_mm512_srli_epi32(codes, 4));
    _mm512_storeu_ps(panel + (2 * pair) * stride, _mm512_add_ps(_mm512_mul_ps(d, q_even), m));
    _mm512_storeu_ps(panel + (2 * pair + 1) * stride, _mm512_add_ps(_mm512_mul_ps(d, q_odd), m));
  }
}

void decode_q8_0(const uint8_t* block, float* panel, int64_t stride) {
  const __m512 d = halves(block);
  for (int k = 0; k < kBlock; ++k) {
    const __m512 q = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sixteen_bytes(block + 32 + 16 * k)));
    _mm512_storeu_ps(panel + k * stride, _mm512_mul_ps(q, d));
  }
}

struct BlockCodes {
  const uint8_t* data;
  int64_t format;
  int64_t k_blocks;
  int64_t block_bytes;

  const uint8_t* block(int64_t tile, int64_t k_block) const {
    return data + (tile * k_blocks + k_block) * block_bytes;
  }
};

// The float32 weights of tiles first .. first + tiles - 1 as a panel [K][tiles * 16].
void decode_panel(const BlockCodes& codes, int64_t first, int tiles, float* panel) {
  const int64_t stride = tiles * kTile;
  for (int64_t k_block = 0; k_block < codes.k_blocks; ++k_block) {
    for (int t = 0; t < tiles; ++t) {
      float* rows = panel + k_block * kBlock * stride + t * kTile;
      const uint8_t* block = codes.block(first + t, k_block);
      if (codes.format == kFormatQ4_1) {
        decode_q4_1(block, rows, stride);
      } else {
        decode_q8_0(block, rows, stride);
      }
    }
  }
}

// out[r, 0 : TILES*16] = x[r, :] @ panel for ROWS rows, in the one summation order above.
template <int ROWS, int TILES>
void rows_times_panel(
    const float* x, int64_t x_stride, const float* panel, int64_t k_size, float* out,
    int64_t out_stride) {
  __m512 acc[ROWS][TILES];
  for (int r = 0; r < ROWS; ++r) {
    for (int t = 0; t < TILES; ++t) {
      acc[r][t] = _mm512_setzero_ps();
    }
  }
  for (int64_t k = 0; k < k_size; ++k) {
    const float* weights = panel + k * TILES * kTile;
    __m512 w[TILES];
    for (int t = 0; t < TILES; ++t) {
      w[t] = _mm512_loadu_ps(weights + t * kTile);
    }
    for (int r = 0; r < ROWS; ++r) {
      const __m512 value = _mm512_set1_ps(x[r * x_stride + k]);
      for (int t = 0; t < TILES; ++t) {
        acc[r][t] = _mm512_fmadd_ps(value, w[t], acc[r][t]);
      }
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    for (int t = 0; t < TILES; ++t) {
      _mm512_storeu_ps(out + r * out_stride + t * kTile, acc[r][t]);
    }
  }
}

// The same as decode_panel + rows_times_panel for at most kRowsPerPass rows, with each weight
// decoded into a register and used there: a decode step's few rows read each code once and
// never write a panel. The weights and the order of the multiply-adds are the same, so are the
// bits.
template <int ROWS, int TILES>
void rows_times_codes(
    const float* x, int64_t x_stride, const BlockCodes& codes, int64_t first, float* out,
    int64_t out_stride) {
  __m512 acc[ROWS][TILES];
  for (int r = 0; r < ROWS; ++r) {
    for (int t = 0; t < TILES; ++t) {
      acc[r][t] = _mm512_setzero_ps();
    }
  }
  const __m512i low_nibble = _mm512_set1_epi32(15);
  for (int64_t k_block = 0; k_block < codes.k_blocks; ++k_block) {
    const uint8_t* blocks[TILES];
    __m512 d[TILES];
    for (int t = 0; t < TILES; ++t) {
      blocks[t] = codes.block(first + t, k_block);
      d[t] = halves(blocks[t]);
    }
    const float* xk = x + k_block * kBlock;
    if (codes.format == kFormatQ4_1) {
      __m512 m[TILES];
      for (int t = 0; t < TILES; ++t) {
        m[t] = halves(blocks[t] + 32);
      }
      for (int pair = 0; pair < kBlock / 2; ++pair) {
        __m512 w_even[TILES], w_odd[TILES];
        for (int t = 0; t < TILES; ++t) {
          const __m512i q = _mm512_cvtepu8_epi32(sixteen_bytes(blocks[t] + 64 + 16 * pair));
          const __m512 q_even = _mm512_cvtepi32_ps(_mm512_and_si512(q, low_nibble));
          const __m512 q_odd = _mm512_cvtepi32_ps(_mm512_srli_epi32(q, 4));
          w_even[t] = _mm512_add_ps(_mm512_mul_ps(d[t], q_even), m[t]);
          w_odd[t] = _mm512_add_ps(_mm512_mul_ps(d[t], q_odd), m[t]);
        }
        for (int r = 0; r < ROWS; ++r) {
          const __m512 even = _mm512_set1_ps(xk[r * x_stride + 2 * pair]);
          const __m512 odd = _mm512_set1_ps(xk[r * x_stride + 2 * pair + 1]);
          for (int t = 0; t < TILES; ++t) {
            acc[r][t] = _mm512_fmadd_ps(even, w_even[t], acc[r][t]);
            acc[r][t] = _mm512_fmadd_ps(odd, w_odd[t], acc[r][t]);
          }
        }
      }
    } else {
      for (int kk = 0; kk < kBlock; ++kk) {
        __m512 w[TILES];
        for (int t = 0; t < TILES; ++t) {
          const __m128i q = sixteen_bytes(blocks[t] + 32 + 16 * kk);
          w[t] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), d[t]);
        }
        for (int r = 0; r < ROWS; ++r) {
          const __m512 value = _mm512_set1_ps(xk[r * x_stride + kk]);
          for (int t = 0; t < TILES; ++t) {
            acc[r][t] = _mm512_fmadd_ps(value, w[t], acc[r][t]);
          }
        }
      }
    }
  }
  for (int r = 0; r < ROWS; ++r) {
    for (int t = 0; t < TILES; ++t) {
      _mm512_storeu_ps(out + r * out_stride + t * kTile, acc[r][t]);
    }
  }
}

using FusedFn = void (*)(const float*, int64_t, const BlockCodes&, int64_t, float*, int64_t);

template <int TILES>
FusedFn fused_for_rows(int rows) {
  switch (rows) {
    case 1: return rows_times_codes<1, TILES>;
    case 2: return rows_times_codes<2, TILES>;
    case 3: return rows_times_codes<3, TILES>;
    case 4: return rows_times_codes<4, TILES>;
    case 5: return rows_times_codes<5, TILES>;
    default: return rows_times_codes<6, TILES>;
  }
}

FusedFn fused_for(int rows, int tiles) {
  switch (tiles) {
    case 1: return fused_for_rows<1>(rows);
    case 2: return fused_for_rows<2>(rows);
    case 3: return fused_for_rows<3>(rows);
    default: return fused_for_rows<4>(rows);
  }
}

using PassFn = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t);

template <int TILES>
PassFn pass_for_rows(int rows) {
  switch (rows) {
    case 1: return rows_times_panel<1, TILES>;
    case 2: return rows_times_panel<2, TILES>;
    case 3: return rows_times_panel<3, TILES>;
    case 4: return rows_times_panel<4, TILES>;
    case 5: return rows_times_panel<5, TILES>;
    default: return rows_times_panel<6, TILES>;
  }
}

PassFn pass_for(int rows, int tiles) {
  switch (tiles) {
    case 1: return pass_for_rows<1>(rows);
    case 2: return pass_for_rows<2>(rows);
    case 3: return pass_for_rows<3>(rows);
    default: return pass_for_rows<4>(rows);
  }
}

void check_codes(const at::Tensor& codes, int64_t n, int64_t k, int64_t format) {
  TORCH_CHECK(format == kFormatQ4_1 || format == kFormatQ8_0, "unknown block format ", format);
  TORCH_CHECK(n > 0 && n % kTile == 0, "output size ", n, " is not a positive multiple of 16");
  TORCH_CHECK(k > 0 && k % kBlock == 0, "input size ", k, " is not a positive multiple of 32");
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous(), "codes: contiguous uint8");
  TORCH_CHECK(
      codes.numel() == (n / kTile) * (k / kBlock) * bytes_per_block(format),
      "codes hold ", codes.numel(), " bytes, not the ", (n / kTile) * (k / kBlock) *
      bytes_per_block(format), " of a ", n, " x ", k, " weight");
}

BlockCodes codes_of(const at::Tensor& codes, int64_t k, int64_t format) {
  return BlockCodes{codes.data_ptr<uint8_t>(), format, k / kBlock, bytes_per_block(format)};
}

// out [M, N] = x [M, K] @ W^T, W the N x K weight that `codes` hold.
void block_linear(at::Tensor& out, const at::Tensor& x, const at::Tensor& codes, int64_t n,
                  int64_t k, int64_t format) {
  check_codes(codes, n, k, format);
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.is_contiguous() && x.dim() == 2 && x.size(1) == k,
              "x: contiguous float32 [M, ", k, "]");
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.dim() == 2 &&
              out.size(0) == x.size(0) && out.size(1) == n, "out: contiguous float32 [M, ", n, "]");
  const BlockCodes weights = codes_of(codes, k, format);
  const int64_t rows = x.size(0);
  const float* x_data = x.data_ptr<float>();
  float* out_data = out.data_ptr<float>();
  if (rows <= kRowsPerPass) {
    at::parallel_for(0, n / kTile, 1, [&](int64_t begin, int64_t end) {
      for (int64_t first = begin; first < end; first += kGroupTiles) {
        const int tiles = static_cast<int>(std::min<int64_t>(kGroupTiles, end - first));
        fused_for(static_cast<int>(rows), tiles)(
            x_data, k, weights, first, out_data + first * kTile, n);
      }
    });
    return;
  }
  at::parallel_for(0, n / kTile, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> panel(static_cast<size_t>(k * kGroupTiles * kTile));
    for (int64_t first = begin; first < end; first += kGroupTiles) {
      const int tiles = static_cast<int>(std::min<int64_t>(kGroupTiles, end - first));
      decode_panel(weights, first, tiles, panel.data());
      for (int64_t row = 0; row < rows; row += kRowsPerPass) {
        const int pass_rows = static_cast<int>(std::min<int64_t>(kRowsPerPass, rows - row));
        pass_for(pass_rows, tiles)(
            x_data + row * k, k, panel.data(), k, out_data + row * n + first * kTile, n);
      }
    }
  });
}

// out [N, K]: the float32 weight that `codes` hold, decoded as `block_linear` decodes it.
void block_dequantize(at::Tensor& out, const at::Tensor& codes, int64_t n, int64_t k,
                      int64_t format) {
  check_codes(codes, n, k, format);
  TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.dim() == 2 &&
              out.size(0) == n && out.size(1) == k, "out: contiguous float32 [", n, ", ", k, "]");
  const BlockCodes weights = codes_of(codes, k, format);
  float* out_data = out.data_ptr<float>();
  at::parallel_for(0, n / kTile, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> panel(static_cast<size_t>(k * kTile));
    for (int64_t tile = begin; tile < end; ++tile) {
      decode_panel(weights, tile, 1, panel.data());
      for (int64_t kk = 0; kk < k; ++kk) {
        for (int64_t j = 0; j < kTile; ++j) {
          out_data[(tile * kTile + j) * k + kk] = panel[kk * kTile + j];
        }
      }
    }
  });
}

}  // namespace

TORCH_LIBRARY(pagedserve_blocks, m) {
  m.def("block_linear(Tensor(a!) out, Tensor x, Tensor codes, int n, int k, int format) -> ()");
  m.def("block_dequantize(Tensor(a!) out, Tensor codes, int n, int k, int format) -> ()");
}

TORCH_LIBRARY_IMPL(pagedserve_blocks, CPU, m) {
  m.impl("block_linear", &block_linear);
  m.impl("block_dequantize", &block_dequantize);
}
