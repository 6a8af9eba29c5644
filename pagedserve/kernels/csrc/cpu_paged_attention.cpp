// Paged attention on the CPU that reads K/V from the block pool in place.
//
// One op covers decode, prefill, chunked prefill and mixed batches: sequence s owns query rows
// query_start_loc[s] .. query_start_loc[s+1] (its last q_len positions), and each attends
// causally to its context through block_tables[s]. Sequences with more than max_query_len new
// tokens are skipped (their rows untouched) for the caller to run elsewhere. Work is cut into
// items
//
//     (sequence, kv head, tile of up to kQueryTile query tokens)
//
// whose G = num_heads / num_kv_heads query heads share the KV head's keys, so one item holds
// rows = tokens * G query rows. An item walks the sequence's blocks with an online softmax:
//
//     pool block b:  [block_size, num_kv_heads, head_dim]    key j, head h: K[b, j, h, :]
//     scores:        [rows, block_size] = q[rows, head_dim] . K[b, :, h, :]
//     acc:           [rows, head_dim]  += exp(scores - max) @ V[b, :, h, :]
//
// Scores come from one of two loops, both vectorised by the compiler over unit-stride data:
// few rows (decode: G rows) take dot products straight from the pool; many rows (prefill
// tiles) first copy the block's keys transposed into `kt` [head_dim, block_size] so that the
// inner loop runs over keys and each transposed key is reused by every row. Nothing larger
// than one block of one head is ever copied.
//
// Float32 and bfloat16 decode items (one new token) whose head_dim fills whole vectors skip
// the online softmax: `attend_decode_float` scores the whole context first (a row of floats
// per head), takes one vectorised max/exp/sum per row, then sums the values; every key and
// value row of the context is read once per item. A bfloat16 pool is read as it is, each
// vector widened to float in registers (`load_float`): all arithmetic is float, and no float
// copy of the context is made. Its prefill tiles likewise sum values from the pool in
// registers (`accumulate_values`).
//
// An 8-bit pool (kv_format 1: fp8 e4m3, 2: fp8 e5m2, 3: int8) stores each (token, kv head) row
// as head_dim 8-bit codes followed by its float32 scale (`kv_quant.py`): row = head_dim + 4 bytes. Its
// items take the generic loop, dequantising each block's rows of their head into scratch
// (`kdq`, `vdq`: one block of one head, as for the transposed keys) through a 256-entry table,
// so the context is never copied whole nor converted.
//
// Items are dealt to at most at::get_num_threads() bins, longest first, so one long prefill
// does not leave a thread idle behind a run of short decodes.

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Float8_e5m2.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

using Vec = at::vec::Vectorized<float>;

// Whether a pool of this element type takes the vector loops: float, or bfloat16 widened to
// float in registers as it is loaded (no float copy of the context is made).
template <typename T>
constexpr bool kVectorPool = std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>;

// Vec::size() elements from p as floats: a plain load, or bfloat16 widened in registers.
template <typename T>
inline Vec load_float(const T* p) {
  if constexpr (std::is_same_v<T, float>) {
    return Vec::loadu(p);
  } else {
    Vec out;
    at::vec::load_to_float<T>(p, out);
    return out;
  }
}

// v into Vec::size() elements at p: a plain store, or rounded to bfloat16 (nearest even).
template <typename T>
inline void store_float(const Vec& v, T* p) {
  if constexpr (std::is_same_v<T, float>) {
    v.store(p);
  } else {
    at::vec::convert_from_float<T>(v, v).store(p, Vec::size());
  }
}

// Query tokens per prefill item: G * 16 rows of scores and accumulators stay in L1.
constexpr int64_t kQueryTile = 16;
// Items with fewer rows than this use dot products; more rows amortise the transposed copy.
constexpr int64_t kTransposeRows = 8;

// exp(x) for x <= 0 (scores minus their running max), vectorisable: 2^n * p(f), |f| <= 1/2,
// with Cephes' exp2f polynomial (relative error ~2e-7, below float32 attention tolerances).
inline float exp_nonpositive(float x) {
  const float t = std::max(x, -87.0f) * 1.44269504088896341f;  // below -87 the result is ~0
  const float n = std::floor(t + 0.5f);
  const float f = t - n;
  float p = 1.535336188319500e-4f;
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// The same exp, eight or sixteen lanes at a time (the scalar one's polynomial and rounding).
inline Vec exp_nonpositive(Vec x) {
  const Vec t = at::vec::maximum(x, Vec(-87.0f)) * Vec(1.44269504088896341f);
  const Vec n = (t + Vec(0.5f)).floor();
  const Vec f = t - n;
  Vec p(1.535336188319500e-4f);
  p = at::vec::fmadd(p, f, Vec(1.339887440266574e-3f));
  p = at::vec::fmadd(p, f, Vec(9.618437357674640e-3f));
  p = at::vec::fmadd(p, f, Vec(5.550332471162809e-2f));
  p = at::vec::fmadd(p, f, Vec(2.402264791363012e-1f));
  p = at::vec::fmadd(p, f, Vec(6.931472028550421e-1f));
  p = at::vec::fmadd(p, f, Vec(1.0f));
  using IVec = at::vec::Vectorized<int32_t>;
  const IVec bits = (at::vec::convert_to_int_of_same_size(n) + IVec(127)) << IVec(23);
  return p * at::vec::cast<float>(bits);
}

struct Dims {
  int64_t num_heads;
  int64_t num_kv_heads;
  int64_t head_dim;
  int64_t block_size;
  int64_t max_blocks;
  int64_t row;  // elements (8-bit: bytes) per pool row: head_dim, or head_dim + 4 for 8-bit
};

// The value of each 8-bit code, by format (1: e4m3fn, 2: e5m2, 3: int8), as torch converts it.
template <int kFmt>
const float* code_table() {
  static const std::vector<float> table = [] {
    std::vector<float> values(256);
    for (int bits = 0; bits < 256; ++bits) {
      const auto code = static_cast<uint8_t>(bits);
      if constexpr (kFmt == 1) {
        values[bits] = static_cast<float>(c10::Float8_e4m3fn(code, c10::Float8_e4m3fn::from_bits()));
      } else if constexpr (kFmt == 3) {
        values[bits] = static_cast<float>(static_cast<int8_t>(code));  // two's complement
      } else {
        values[bits] = static_cast<float>(c10::Float8_e5m2(code, c10::Float8_e5m2::from_bits()));
      }
    }
    return values;
  }();
  return table.data();
}

// n 8-bit rows (codes, then the float32 scale) of one head, `stride` bytes apart, into dst[n, D].
template <int kFmt>
void dequantise_rows(float* dst, const uint8_t* src, int64_t n, int64_t D, int64_t stride) {
  const float* table = code_table<kFmt>();
  for (int64_t j = 0; j < n; ++j) {
    const uint8_t* row = src + j * stride;
    float scale;
    std::memcpy(&scale, row + D, sizeof(scale));
    float* out = dst + j * D;
    for (int64_t c = 0; c < D; ++c) out[c] = table[row[c]] * scale;
  }
}

struct Item {
  int64_t seq;
  int64_t kv_head;
  int64_t q_lo;  // first query token of the tile, counted within the sequence's new tokens
  int64_t q_hi;
  int64_t q_len;  // the sequence's new tokens (a decode item: q_len 1)
  int64_t cost;  // query rows * keys read: the work the bins balance
};

// One thread's scratch, sized once for the largest tile.
struct Scratch {
  std::vector<float> q, acc, kt, scores, row_max, row_sum;
  std::vector<float> logits;  // decode: [rows, context], grown to the longest context seen
  std::vector<float> kdq, vdq;  // 8-bit pools: one block of one head's keys / values, dequantised

  Scratch(int64_t rows, const Dims& d)
      : q(rows * d.head_dim),
        acc(rows * d.head_dim),
        kt(d.head_dim * d.block_size),
        kdq(d.row != d.head_dim ? d.block_size * d.head_dim : 0),
        vdq(d.row != d.head_dim ? d.block_size * d.head_dim : 0),
        scores(rows * d.block_size),
        row_max(rows),
        row_sum(rows) {}
};

// scores[r, j] = q[r] . K[j] for j < n, reading each key from the pool.
template <typename scalar_t, int64_t kD>
void scores_by_dot(
    float* scores, const float* q, const scalar_t* kb, int64_t rows, int64_t n, int64_t D,
    int64_t BS, int64_t token_stride) {
  const int64_t dim = kD > 0 ? kD : D;
  for (int64_t j = 0; j < n; ++j) {
    const scalar_t* krow = kb + j * token_stride;
    for (int64_t r = 0; r < rows; ++r) {
      const float* qr = q + r * dim;
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int64_t c = 0; c < dim; ++c) dot += qr[c] * static_cast<float>(krow[c]);
      scores[r * BS + j] = dot;
    }
  }
}

// The same scores through a transposed copy of the block's keys (many rows). Float pools
// with whole vectors of keys per block take explicit vectors, four rows at a time (four
// independent FMA chains, one load of each transposed key vector for all four).
template <typename scalar_t, int64_t kD>
void scores_by_transpose(
    float* scores, float* kt, const float* q, const scalar_t* kb, int64_t rows, int64_t n,
    int64_t D, int64_t BS, int64_t token_stride) {
  const int64_t dim = kD > 0 ? kD : D;
  for (int64_t j = 0; j < n; ++j) {
    const scalar_t* krow = kb + j * token_stride;
    for (int64_t c = 0; c < dim; ++c) kt[c * BS + j] = static_cast<float>(krow[c]);
  }
  int64_t r = 0;
  if (BS % Vec::size() == 0) {
    // Keys n .. BS of a partial block hold stale (finite) values: scored, then never used.
    for (; r + 4 <= rows; r += 4) {
      for (int64_t j = 0; j < BS; j += Vec::size()) {
        Vec acc0(0.0f), acc1(0.0f), acc2(0.0f), acc3(0.0f);
        for (int64_t c = 0; c < dim; ++c) {
          const Vec k = Vec::loadu(kt + c * BS + j);
          acc0 = at::vec::fmadd(Vec(q[r * dim + c]), k, acc0);
          acc1 = at::vec::fmadd(Vec(q[(r + 1) * dim + c]), k, acc1);
          acc2 = at::vec::fmadd(Vec(q[(r + 2) * dim + c]), k, acc2);
          acc3 = at::vec::fmadd(Vec(q[(r + 3) * dim + c]), k, acc3);
        }
        acc0.store(scores + r * BS + j);
        acc1.store(scores + (r + 1) * BS + j);
        acc2.store(scores + (r + 2) * BS + j);
        acc3.store(scores + (r + 3) * BS + j);
      }
    }
  }
  for (; r < rows; ++r) {
    float* sr = scores + r * BS;
    const float* qr = q + r * dim;
    std::fill(sr, sr + n, 0.0f);
    for (int64_t c = 0; c < dim; ++c) {
      const float qc = qr[c];
      const float* ktc = kt + c * BS;
#pragma omp simd
      for (int64_t j = 0; j < n; ++j) sr[j] += qc * ktc[j];
    }
  }
}

// acc[D] = acc * alpha + sum_j p[j] * V[j] over `visible` keys of one block.
template <typename scalar_t, int64_t kD>
void accumulate_values(
    float* acc, float alpha, const float* p, const scalar_t* vb, int64_t visible, int64_t D,
    int64_t token_stride) {
  if constexpr (kVectorPool<scalar_t> && kD > 0 && kD % Vec::size() == 0) {
    // The whole accumulator row in registers, one FMA chain per vector of it.
    constexpr int64_t kChunks = kD / Vec::size();
    Vec a[kChunks];
    for (int64_t k = 0; k < kChunks; ++k) a[k] = Vec::loadu(acc + k * Vec::size()) * Vec(alpha);
    for (int64_t j = 0; j < visible; ++j) {
      const Vec pj(p[j]);
      const scalar_t* vrow = vb + j * token_stride;
      for (int64_t k = 0; k < kChunks; ++k) {
        a[k] = at::vec::fmadd(pj, load_float(vrow + k * Vec::size()), a[k]);
      }
    }
    for (int64_t k = 0; k < kChunks; ++k) a[k].store(acc + k * Vec::size());
  } else {
    if (alpha != 1.0f) {
#pragma omp simd
      for (int64_t c = 0; c < D; ++c) acc[c] *= alpha;
    }
    for (int64_t j = 0; j < visible; ++j) {
      const float pj = p[j];
      const scalar_t* vrow = vb + j * token_stride;
#pragma omp simd
      for (int64_t c = 0; c < D; ++c) acc[c] += pj * static_cast<float>(vrow[c]);
    }
  }
}

// A decode item (one query token, its G heads) of a float32 or bfloat16 pool, in two passes
// over the context instead of an online softmax per block: every score first (each key row
// read once, for all G rows), then one max, exp and sum per row, vectorised, then every value
// row read once into each row's register accumulator. No rescaling per block, no scalar exp.
template <typename scalar_t, int64_t kD>
void attend_decode_float(
    const Item& item, const scalar_t* query, scalar_t* out, const scalar_t* key_cache,
    const scalar_t* value_cache, const int32_t* block_tables, const int32_t* query_start_loc,
    const int32_t* seq_lens, const Dims& d, float scale, Scratch& s) {
  constexpr int64_t kChunks = kD / Vec::size();
  const int64_t BS = d.block_size, G = d.num_heads / d.num_kv_heads;
  const int64_t token_stride = d.num_kv_heads * kD;
  const int64_t token = query_start_loc[item.seq];
  const int64_t num_keys = seq_lens[item.seq];
  const int32_t* table = block_tables + item.seq * d.max_blocks;
  scalar_t* dst = out + (token * d.num_heads + item.kv_head * G) * kD;
  if (num_keys <= 0) {  // an empty context: zeros, as in the torch reference
    std::fill(dst, dst + G * kD, static_cast<scalar_t>(0.0f));
    return;
  }
  for (int64_t r = 0; r < G; ++r) {
    const scalar_t* src = query + (token * d.num_heads + item.kv_head * G + r) * kD;
    for (int64_t k = 0; k < kChunks; ++k) {
      (load_float(src + k * Vec::size()) * Vec(scale)).store(s.q.data() + r * kD + k * Vec::size());
    }
  }
  if (static_cast<int64_t>(s.logits.size()) < G * num_keys) s.logits.resize(G * num_keys);
  float* logits = s.logits.data();  // row r at logits + r * num_keys

  const int64_t num_blocks = (num_keys + BS - 1) / BS;
  for (int64_t b = 0; b < num_blocks; ++b) {
    const int64_t key0 = b * BS, n = std::min(BS, num_keys - key0);
    const scalar_t* kb = key_cache + static_cast<int64_t>(table[b]) * BS * token_stride +
                      item.kv_head * kD;
    for (int64_t j = 0; j < n; ++j) {
      Vec key[kChunks];
      const scalar_t* krow = kb + j * token_stride;
      for (int64_t k = 0; k < kChunks; ++k) key[k] = load_float(krow + k * Vec::size());
      for (int64_t r = 0; r < G; ++r) {
        const float* qr = s.q.data() + r * kD;
        Vec dot = Vec::loadu(qr) * key[0];
        for (int64_t k = 1; k < kChunks; ++k) {
          dot = at::vec::fmadd(Vec::loadu(qr + k * Vec::size()), key[k], dot);
        }
        logits[r * num_keys + key0 + j] = dot.reduce_add();
      }
    }
  }

  const int64_t whole = num_keys - num_keys % Vec::size();
  for (int64_t r = 0; r < G; ++r) {
    float* lr = logits + r * num_keys;
    float max = -std::numeric_limits<float>::infinity();
    Vec vmax(max);
    for (int64_t j = 0; j < whole; j += Vec::size()) {
      vmax = at::vec::maximum(vmax, Vec::loadu(lr + j));
    }
    max = vmax.reduce_max();
    for (int64_t j = whole; j < num_keys; ++j) max = std::max(max, lr[j]);
    Vec vsum(0.0f);
    for (int64_t j = 0; j < whole; j += Vec::size()) {
      const Vec e = exp_nonpositive(Vec::loadu(lr + j) - Vec(max));
      e.store(lr + j);
      vsum = vsum + e;
    }
    float sum = vsum.reduce_add();
    for (int64_t j = whole; j < num_keys; ++j) {
      lr[j] = exp_nonpositive(lr[j] - max);
      sum += lr[j];
    }
    s.row_sum[r] = sum;
  }

  for (int64_t r = 0; r < G; ++r) {
    const float* pr = logits + r * num_keys;
    Vec acc[kChunks];
    for (int64_t k = 0; k < kChunks; ++k) acc[k] = Vec(0.0f);
    for (int64_t b = 0; b < num_blocks; ++b) {
      const int64_t key0 = b * BS, n = std::min(BS, num_keys - key0);
      const scalar_t* vb = value_cache + static_cast<int64_t>(table[b]) * BS * token_stride +
                        item.kv_head * kD;
      for (int64_t j = 0; j < n; ++j) {
        const Vec pj(pr[key0 + j]);
        for (int64_t k = 0; k < kChunks; ++k) {
          acc[k] = at::vec::fmadd(pj, load_float(vb + j * token_stride + k * Vec::size()), acc[k]);
        }
      }
    }
    const Vec inv(1.0f / s.row_sum[r]);
    for (int64_t k = 0; k < kChunks; ++k) store_float(acc[k] * inv, dst + r * kD + k * Vec::size());
  }
}

// The pool's element type: the query's, or bytes for an 8-bit pool (kFmt 1, 2 or 3).
template <typename scalar_t, int kFmt>
using cache_t = std::conditional_t<kFmt == 0, scalar_t, uint8_t>;
// What the score and value loops read: the pool itself, or dequantised float scratch.
template <typename scalar_t, int kFmt>
using kv_t = std::conditional_t<kFmt == 0, scalar_t, float>;

template <typename scalar_t, int64_t kD, int kFmt>
void attend_item(
    const Item& item, const scalar_t* query, scalar_t* out,
    const cache_t<scalar_t, kFmt>* key_cache, const cache_t<scalar_t, kFmt>* value_cache,
    const int32_t* block_tables, const int32_t* query_start_loc, const int32_t* seq_lens,
    const Dims& d, float scale, Scratch& s) {
  using read_t = kv_t<scalar_t, kFmt>;
  const int64_t D = kD > 0 ? kD : d.head_dim;
  const int64_t BS = d.block_size, G = d.num_heads / d.num_kv_heads;
  const int64_t rows = (item.q_hi - item.q_lo) * G;
  const int64_t pool_stride = d.num_kv_heads * d.row;  // between pool rows of one block
  // Between the rows the loops read: the pool's, or the dequantised scratch's.
  const int64_t token_stride = kFmt == 0 ? pool_stride : D;
  const int64_t q_start = query_start_loc[item.seq];
  const int64_t q_len = query_start_loc[item.seq + 1] - q_start;
  const int64_t first_pos = seq_lens[item.seq] - q_len;  // position of the first new token
  const int64_t num_keys = first_pos + item.q_hi;  // the newest row sees keys 0 .. this - 1
  const int32_t* table = block_tables + item.seq * d.max_blocks;

  // Row r is query token q_lo + r / G, head kv_head * G + r % G; scaled once here.
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t token = q_start + item.q_lo + r / G;
    const scalar_t* src = query + (token * d.num_heads + item.kv_head * G + r % G) * D;
    float* dst = s.q.data() + r * D;
    for (int64_t c = 0; c < D; ++c) dst[c] = static_cast<float>(src[c]) * scale;
  }
  std::fill(s.acc.begin(), s.acc.begin() + rows * D, 0.0f);
  std::fill(s.row_max.begin(), s.row_max.begin() + rows, -std::numeric_limits<float>::infinity());
  std::fill(s.row_sum.begin(), s.row_sum.begin() + rows, 0.0f);

  const int64_t num_blocks = (num_keys + BS - 1) / BS;
  for (int64_t b = 0; b < num_blocks; ++b) {
    const int64_t key0 = b * BS;
    const int64_t n = std::min(BS, num_keys - key0);
    const int64_t base = static_cast<int64_t>(table[b]) * BS * pool_stride + item.kv_head * d.row;
    const read_t* kb;
    const read_t* vb;
    if constexpr (kFmt == 0) {
      kb = key_cache + base;
      vb = value_cache + base;
    } else {
      dequantise_rows<kFmt>(s.kdq.data(), key_cache + base, n, D, pool_stride);
      dequantise_rows<kFmt>(s.vdq.data(), value_cache + base, n, D, pool_stride);
      kb = s.kdq.data();
      vb = s.vdq.data();
    }
    if (rows < kTransposeRows) {
      scores_by_dot<read_t, kD>(s.scores.data(), s.q.data(), kb, rows, n, D, BS, token_stride);
    } else {
      scores_by_transpose<read_t, kD>(
          s.scores.data(), s.kt.data(), s.q.data(), kb, rows, n, D, BS, token_stride);
    }
    for (int64_t r = 0; r < rows; ++r) {
      // Keys this row may see in the block: all of them, except on the causal diagonal.
      const int64_t visible = std::min(n, first_pos + item.q_lo + r / G - key0 + 1);
      if (visible <= 0) continue;
      float* sr = s.scores.data() + r * BS;
      float new_max = s.row_max[r];
      for (int64_t j = 0; j < visible; ++j) new_max = std::max(new_max, sr[j]);
      // Before its first key a row's max is -inf: alpha is ~0 and scales only zeros.
      const float alpha = exp_nonpositive(s.row_max[r] - new_max);
      float block_sum = 0.0f;
#pragma omp simd reduction(+ : block_sum)
      for (int64_t j = 0; j < visible; ++j) {
        sr[j] = exp_nonpositive(sr[j] - new_max);
        block_sum += sr[j];
      }
      s.row_max[r] = new_max;
      s.row_sum[r] = s.row_sum[r] * alpha + block_sum;
      accumulate_values<read_t, kD>(
          s.acc.data() + r * D, alpha, sr, vb, visible, D, token_stride);
    }
  }

  for (int64_t r = 0; r < rows; ++r) {
    const int64_t token = q_start + item.q_lo + r / G;
    // A row that saw no key (an empty context) is zero, as in the torch reference.
    const float inv = s.row_sum[r] > 0.0f ? 1.0f / s.row_sum[r] : 0.0f;
    const float* ar = s.acc.data() + r * D;
    scalar_t* dst = out + (token * d.num_heads + item.kv_head * G + r % G) * D;
    for (int64_t c = 0; c < D; ++c) dst[c] = static_cast<scalar_t>(ar[c] * inv);
  }
}

// Cut the batch into items, checking every table entry an item will read.
std::vector<Item> make_items(
    const int32_t* block_tables, const int32_t* query_start_loc, const int32_t* seq_lens,
    int64_t num_seqs, int64_t num_tokens, int64_t num_pool_blocks, int64_t max_query_len,
    const Dims& d) {
  std::vector<Item> items;
  const int64_t G = d.num_heads / d.num_kv_heads;
  TORCH_CHECK_VALUE(
      query_start_loc[0] >= 0 && query_start_loc[num_seqs] <= num_tokens, "query_start_loc runs ",
      query_start_loc[0], " .. ", query_start_loc[num_seqs], " outside the ", num_tokens,
      " query tokens");
  for (int64_t seq = 0; seq < num_seqs; ++seq) {
    const int64_t q_len = query_start_loc[seq + 1] - query_start_loc[seq];
    const int64_t ctx = seq_lens[seq];
    TORCH_CHECK_VALUE(q_len >= 0, "query_start_loc must not decrease (sequence ", seq, ")");
    // A decode row of an empty context (q_len 1, seq_lens 0) is allowed and yields zeros.
    TORCH_CHECK_VALUE(
        q_len <= std::max<int64_t>(ctx, 1), "sequence ", seq, ": ", q_len,
        " new tokens exceed seq_lens[", seq, "] = ", ctx);
    const int64_t needed = (ctx + d.block_size - 1) / d.block_size;
    TORCH_CHECK_VALUE(
        needed <= d.max_blocks, "block_tables has ", d.max_blocks, " columns but a context of ",
        ctx, " tokens needs ", needed, " blocks of ", d.block_size);
    const int32_t* table = block_tables + seq * d.max_blocks;
    for (int64_t b = 0; b < needed; ++b) {
      TORCH_CHECK_VALUE(
          table[b] >= 0 && table[b] < num_pool_blocks, "block_tables[", seq, ", ", b, "] = ",
          table[b], " is outside the pool of ", num_pool_blocks, " blocks");
    }
    if (q_len > max_query_len) continue;  // left to the caller
    for (int64_t lo = 0; lo < q_len; lo += kQueryTile) {
      const int64_t hi = std::min(q_len, lo + kQueryTile);
      const int64_t keys = std::max<int64_t>(ctx - q_len + hi, 1);
      for (int64_t h = 0; h < d.num_kv_heads; ++h) {
        items.push_back({seq, h, lo, hi, q_len, (hi - lo) * G * keys});
      }
    }
  }
  return items;
}

// Deal items to `num_bins` bins, longest first, each to the least loaded bin (LPT).
std::vector<std::vector<Item>> balance(std::vector<Item> items, int64_t num_bins) {
  std::sort(items.begin(), items.end(), [](const Item& a, const Item& b) {
    return a.cost > b.cost;
  });
  std::vector<std::vector<Item>> bins(num_bins);
  std::vector<int64_t> load(num_bins, 0);
  for (const Item& item : items) {
    const auto lightest = std::min_element(load.begin(), load.end()) - load.begin();
    bins[lightest].push_back(item);
    load[lightest] += item.cost;
  }
  return bins;
}

template <typename scalar_t, int64_t kD, int kFmt>
void run_bins(
    const std::vector<std::vector<Item>>& bins, const at::Tensor& out, const at::Tensor& query,
    const at::Tensor& key_cache, const at::Tensor& value_cache, const at::Tensor& block_tables,
    const at::Tensor& query_start_loc, const at::Tensor& seq_lens, const Dims& d, float scale) {
  const int64_t max_rows = kQueryTile * (d.num_heads / d.num_kv_heads);
  at::parallel_for(0, static_cast<int64_t>(bins.size()), 1, [&](int64_t begin, int64_t end) {
    Scratch scratch(max_rows, d);
    for (int64_t bin = begin; bin < end; ++bin) {
      for (const Item& item : bins[bin]) {
        if constexpr (kVectorPool<scalar_t> && kFmt == 0 && kD > 0 && kD % Vec::size() == 0) {
          if (item.q_len == 1) {
            attend_decode_float<scalar_t, kD>(
                item, query.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
                key_cache.data_ptr<scalar_t>(), value_cache.data_ptr<scalar_t>(),
                block_tables.data_ptr<int32_t>(), query_start_loc.data_ptr<int32_t>(),
                seq_lens.data_ptr<int32_t>(), d, scale, scratch);
            continue;
          }
        }
        attend_item<scalar_t, kD, kFmt>(
            item, query.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
            key_cache.data_ptr<cache_t<scalar_t, kFmt>>(),
            value_cache.data_ptr<cache_t<scalar_t, kFmt>>(),
            block_tables.data_ptr<int32_t>(), query_start_loc.data_ptr<int32_t>(),
            seq_lens.data_ptr<int32_t>(), d, scale, scratch);
      }
    }
  });
}

void paged_attention(
    at::Tensor& out, const at::Tensor& query, const at::Tensor& key_cache,
    const at::Tensor& value_cache, const at::Tensor& block_tables,
    const at::Tensor& query_start_loc, const at::Tensor& seq_lens, double scale,
    int64_t max_query_len, int64_t kv_format) {
  // The Python wrapper checks shapes and dtypes; these guard the raw pointer arithmetic.
  TORCH_CHECK(query.is_contiguous() && out.is_contiguous(), "query and out must be contiguous");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "pools must be contiguous");
  TORCH_CHECK(
      block_tables.scalar_type() == at::kInt && query_start_loc.scalar_type() == at::kInt &&
          seq_lens.scalar_type() == at::kInt && block_tables.is_contiguous(),
      "index tensors must be contiguous int32");
  TORCH_CHECK(
      kv_format >= 0 && kv_format <= 3, "kv_format must be 0, 1 (e4m3), 2 (e5m2) or 3 (int8)");
  const bool quantised = kv_format != 0;
  // An 8-bit pool arrives as bytes, each row head_dim codes and a 4-byte scale.
  const int64_t pool_head_dim =
      key_cache.dim() == 4 ? key_cache.size(3) - (quantised ? 4 : 0) : -1;
  TORCH_CHECK(
      query.dim() == 3 && key_cache.dim() == 4 && query.size(2) == pool_head_dim &&
          query.size(1) % key_cache.size(2) == 0 && out.sizes() == query.sizes() &&
          out.scalar_type() == query.scalar_type() &&
          key_cache.scalar_type() == (quantised ? at::kByte : query.scalar_type()) &&
          value_cache.sizes() == key_cache.sizes() &&
          value_cache.scalar_type() == key_cache.scalar_type(),
      "query/out [tokens, heads, head_dim] and pools [blocks, block_size, kv_heads, head_dim] "
      "(8-bit: uint8 rows of head_dim + 4) must agree in head_dim, head grouping and dtype");
  TORCH_CHECK(
      block_tables.dim() == 2 && block_tables.size(0) == seq_lens.size(0) &&
          query_start_loc.size(0) == seq_lens.size(0) + 1,
      "block_tables [S, max_blocks], seq_lens [S] and query_start_loc [S + 1] must agree");
  const Dims d{
      query.size(1), key_cache.size(2), pool_head_dim, key_cache.size(1),
      block_tables.size(1), key_cache.size(3)};
  std::vector<Item> items = make_items(
      block_tables.data_ptr<int32_t>(), query_start_loc.data_ptr<int32_t>(),
      seq_lens.data_ptr<int32_t>(), seq_lens.size(0), query.size(0), key_cache.size(0),
      max_query_len, d);
  if (items.empty()) return;
  const int64_t num_bins = std::min<int64_t>(at::get_num_threads(), items.size());
  const auto bins = balance(std::move(items), num_bins);
  const auto fscale = static_cast<float>(scale);
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, query.scalar_type(), "paged_attention_cpu", [&] {
        // 8-bit pools: a generic loop over dequantised scratch, per format.
        if (kv_format == 1) {
          return run_bins<scalar_t, 0, 1>(
              bins, out, query, key_cache, value_cache, block_tables, query_start_loc,
              seq_lens, d, fscale);
        }
        if (kv_format == 2) {
          return run_bins<scalar_t, 0, 2>(
              bins, out, query, key_cache, value_cache, block_tables, query_start_loc,
              seq_lens, d, fscale);
        }
        if (kv_format == 3) {
          return run_bins<scalar_t, 0, 3>(
              bins, out, query, key_cache, value_cache, block_tables, query_start_loc,
              seq_lens, d, fscale);
        }
        // Common head sizes get loops of known length (unrolled); others a generic loop.
        switch (d.head_dim) {
          case 32:
            return run_bins<scalar_t, 32, 0>(
                bins, out, query, key_cache, value_cache, block_tables, query_start_loc,
                seq_lens, d, fscale);
          case 64:
            return run_bins<scalar_t, 64, 0>(
                bins, out, query, key_cache, value_cache, block_tables, query_start_loc,
                seq_lens, d, fscale);
          case 128:
            return run_bins<scalar_t, 128, 0>(
                bins, out, query, key_cache, value_cache, block_tables, query_start_loc,
                seq_lens, d, fscale);
          default:
            return run_bins<scalar_t, 0, 0>(
                bins, out, query, key_cache, value_cache, block_tables, query_start_loc,
                seq_lens, d, fscale);
        }
      });
}

}  // namespace

TORCH_LIBRARY(pagedserve_cpu, m) {
  m.def(
      "paged_attention(Tensor(a!) out, Tensor query, Tensor key_cache, Tensor value_cache, "
      "Tensor block_tables, Tensor query_start_loc, Tensor seq_lens, float scale, "
      "int max_query_len, int kv_format) -> ()");
}

TORCH_LIBRARY_IMPL(pagedserve_cpu, CPU, m) {
  m.impl("paged_attention", &paged_attention);
}
