// What a load does to every byte of a GGUF file's quantised tensors, in one pass each: numpy's
// code (bridge/gguf/int4.py, bridge/gguf/read.py, bridge/quantize.py) makes a dozen. Plain C
// functions with no framework: bridge/native built and loads this file (`jax-llama kernels
// build` builds it beside the decode kernels), bridge/gguf/native.py calls it through ctypes on
// chunks of rows from bridge.parallel's threads (ctypes lets go of Python's lock), and every
// function writes the very bytes numpy's code writes (tests/test_native.py holds them equal).
// Built for x86-64-v4 or v3 where the CPU runs it, else with what SSSE3 and F16C it has,
// else plain C++; never with fused multiply-adds (-ffp-contract=off): numpy rounds each step.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#include "half.h"

// A Q4_K super-block's 6-bit scale sc_j and minimum m_j of group j, from its 12 bytes q6
// (llama.cpp's get_scale_min_k4; gguf's Q4_K.get_scale_min).
static inline void ScaleMin(const uint8_t* q6, int j, int* sc, int* m) {
  if (j < 4) {
    *sc = q6[j] & 63, *m = q6[j + 4] & 63;
  } else {
    *sc = (q6[j + 4] & 0x0F) | ((q6[j - 4] >> 6) << 4);
    *m = (q6[j + 4] >> 4) | ((q6[j] >> 6) << 4);
  }
}

// llama.cpp's plain 4-bit blocks (Q4_0: float16 d, 16 bytes of q; Q4_1:
// float16 d and m, 16 bytes) -> bridge.int4's 4-bit layout, n blocks from `blocks` (each
// block_bytes long) into packed (16 bytes a block), d and m (float16 bits, a block each; m null
// for Q4_0). A block's byte j holds its q[j] and q[j + 16] (low nibble first); packed byte k < 8
// holds q[2k] and q[2k + 1], byte 8 + k q[16 + 2k] and q[17 + 2k]: bridge/gguf/int4.py's
// from_q4_blocks does the same in numpy.
extern "C" void bridge_from_q4_blocks(const uint8_t* blocks, int64_t n, int64_t block_bytes,
                                         uint8_t* packed, uint16_t* d, uint16_t* m) {
  for (int64_t i = 0; i < n; ++i) {
    const uint8_t* block = blocks + i * block_bytes;
    const uint8_t* qs = block + block_bytes - 16;
    uint8_t* out = packed + i * 16;
    std::memcpy(d + i, block, 2);
    if (m != nullptr) std::memcpy(m + i, block + 2, 2);
#if defined(__SSSE3__)
    const __m128i low4 = _mm_set1_epi8(0x0F);
    const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
    const __m128i lo = _mm_and_si128(v, low4), hi = _mm_and_si128(_mm_srli_epi16(v, 4), low4);
    const __m128i evens_lo = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, -1, -1, -1, -1, -1, -1, -1, -1);
    const __m128i evens_hi = _mm_setr_epi8(-1, -1, -1, -1, -1, -1, -1, -1, 0, 2, 4, 6, 8, 10, 12, 14);
    const __m128i odds_lo = _mm_setr_epi8(1, 3, 5, 7, 9, 11, 13, 15, -1, -1, -1, -1, -1, -1, -1, -1);
    const __m128i odds_hi = _mm_setr_epi8(-1, -1, -1, -1, -1, -1, -1, -1, 1, 3, 5, 7, 9, 11, 13, 15);
    // first weights of each pair (q[2k], q[16 + 2k]) and second ones, then a pair a byte
    const __m128i first = _mm_or_si128(_mm_shuffle_epi8(lo, evens_lo), _mm_shuffle_epi8(hi, evens_hi));
    const __m128i second = _mm_or_si128(_mm_shuffle_epi8(lo, odds_lo), _mm_shuffle_epi8(hi, odds_hi));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out),
                     _mm_or_si128(first, _mm_slli_epi16(second, 4)));  // second < 16: no carry
#else
    for (int k = 0; k < 8; ++k) {
      const uint8_t a = qs[2 * k], b = qs[2 * k + 1];
      out[k] = uint8_t((a & 0x0F) | ((b & 0x0F) << 4));
      out[8 + k] = uint8_t((a >> 4) | (b & 0xF0));
    }
#endif
  }
}

// Loading: one row of a GGUF tensor's blocks -> its float32 weights, bridge/gguf/read.py's
// dequantisation bit for bit (each product and difference rounded to float32 as there). kind: 0
// Q8_0 (float16 d, 32 int8 q: d q), 1 Q4_0 (float16 d, 16 bytes: d (q - 8); byte j holds
// weights j and j + 16), 2 Q6_K (256 weights: 128 bytes of low nibbles, 64 of 2-bit highs, 16
// int8 scales, float16 d: (q - 32) (d sc_j), 16 weights a scale), 3 Q4_K (as
// bridge_from_q4_k_blocks reads it: q (d sc_j) - dmin m_j).
static void DequantizeRow(int kind, const uint8_t* row, int64_t cols, float* w) {
  uint16_t bits;
  if (kind == 0 || kind == 1) {
    const int64_t block_bytes = kind == 0 ? 34 : 18;
    for (int64_t b = 0; b < cols / 32; ++b) {
      const uint8_t* block = row + b * block_bytes;
      std::memcpy(&bits, block, 2);
      const float d = HalfToFloat(bits);
      float* out = w + b * 32;
      if (kind == 0) {
        const int8_t* qs = reinterpret_cast<const int8_t*>(block + 2);
        for (int j = 0; j < 32; ++j) out[j] = float(qs[j]) * d;
      } else {
        for (int j = 0; j < 16; ++j) {
          out[j] = d * float(int(block[2 + j] & 0x0F) - 8);
          out[j + 16] = d * float(int(block[2 + j] >> 4) - 8);
        }
      }
    }
  } else if (kind == 2) {
    for (int64_t b = 0; b < cols / 256; ++b) {
      const uint8_t* block = row + b * 210;
      std::memcpy(&bits, block + 208, 2);
      const float d = HalfToFloat(bits);
      const int8_t* sc = reinterpret_cast<const int8_t*>(block + 192);
      for (int half = 0; half < 2; ++half) {  // weight t of a half: ql[t % 64] >> 4 (t / 64),
        const uint8_t* ql = block + half * 64;  // qh[t % 32] >> 2 (t / 32), scale t / 16
        const uint8_t* qh = block + 128 + half * 32;
        const int8_t* s = sc + half * 8;
        float* y = w + b * 256 + half * 128;
        for (int l = 0; l < 32; ++l) {
          const int q1 = (ql[l] & 0x0F) | ((qh[l] & 3) << 4);
          const int q2 = (ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4);
          const int q3 = (ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4);
          const int q4 = (ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4);
          y[l] = float(q1 - 32) * (d * float(s[l / 16]));
          y[l + 32] = float(q2 - 32) * (d * float(s[l / 16 + 2]));
          y[l + 64] = float(q3 - 32) * (d * float(s[l / 16 + 4]));
          y[l + 96] = float(q4 - 32) * (d * float(s[l / 16 + 6]));
        }
      }
    }
  } else {
    for (int64_t b = 0; b < cols / 256; ++b) {
      const uint8_t* block = row + b * 144;
      uint16_t dd[2];
      std::memcpy(dd, block, 4);
      const float d = HalfToFloat(dd[0]), dmin = HalfToFloat(dd[1]);
      const uint8_t* q6 = block + 4;
      for (int j = 0; j < 8; ++j) {
        int sc, m;
        ScaleMin(q6, j, &sc, &m);
        const float scale = d * float(sc), minimum = dmin * float(m);
        const uint8_t* run = block + 16 + (j / 2) * 32;
        for (int k = 0; k < 32; ++k) {
          const float product = float((j & 1) ? run[k] >> 4 : run[k] & 0x0F) * scale;
          w[b * 256 + j * 32 + k] = product - minimum;
        }
      }
    }
  }
}

// Loading: rows of a GGUF tensor's blocks (DequantizeRow's kinds) -> int8 rows with one float32
// scale a row, as bridge/quantize.py's quantize_weight makes them from the dequantised rows, bit
// for bit: s = max |w| / 127 (1 for a row of zeros), q' = w / s rounded to even within +-127.
// sums[0] += the squared change (q' s - w, in float32) and sums[1] += the squared weights, in
// double: the error bridge.int4.QuantisedReader reports. The embedding and the LM head of a
// quantised GGUF, which the kernels read as int8 rows (matvec_int8_rows), and its 6- and 8-bit
// projections.
extern "C" void bridge_int8_rows(const uint8_t* blocks, int64_t rows, int64_t cols, int kind,
                                    int8_t* q, float* scale, double* sums) {
  const int64_t row_bytes = kind == 0 ? cols / 32 * 34 : kind == 1 ? cols / 32 * 18
                          : kind == 2 ? cols / 256 * 210 : cols / 256 * 144;
  std::vector<float> w(cols);
  double change = 0, norm = 0;
  for (int64_t r = 0; r < rows; ++r) {
    DequantizeRow(kind, blocks + r * row_bytes, cols, w.data());
    // in 16 lanes (cols is whole blocks of 32), which the compiler makes vectors
    float lane_max[16] = {0};
    for (int64_t j = 0; j < cols; j += 16)
      for (int k = 0; k < 16; ++k) lane_max[k] = std::max(lane_max[k], std::fabs(w[j + k]));
    float amax = 0;
    for (int k = 0; k < 16; ++k) amax = std::max(amax, lane_max[k]);
    const float s = amax > 0 ? amax / 127.0f : 1.0f;
    const float even = 12582912.0f;  // 1.5 * 2^23: (x + even) - even rounds |x| < 2^22 to even
    int8_t* qrow = q + r * cols;
    double lane_change[16] = {0}, lane_norm[16] = {0};
    for (int64_t j = 0; j < cols; j += 16)
      for (int k = 0; k < 16; ++k) {
        const float x = w[j + k];
        const float v = std::min(127.0f, std::max(-127.0f, (x / s + even) - even));
        qrow[j + k] = static_cast<int8_t>(v);
        const float diff = v * s - x;
        lane_change[k] += double(diff) * double(diff);
        lane_norm[k] += double(x) * double(x);
      }
    for (int k = 0; k < 16; ++k) change += lane_change[k], norm += lane_norm[k];
    scale[r] = s;
  }
  sums[0] += change, sums[1] += norm;
}

// float32 -> float16 bits, rounded to nearest even (numpy's astype(np.float16) of the same value)
static inline uint16_t FloatToHalf(float f) {
#if defined(__F16C__)
  return static_cast<uint16_t>(_cvtss_sh(f, 0));
#else
  uint32_t x;
  std::memcpy(&x, &f, 4);
  const uint32_t sign = (x >> 16) & 0x8000, mag = x & 0x7FFFFFFF;
  if (mag > 0x7F800000) return uint16_t(sign | 0x7E00);         // NaN
  if (mag >= 0x477FF000) return uint16_t(sign | 0x7C00);        // 65520 and up round to inf
  if (mag < 0x38800000)                                         // below 2^-14: subnormal steps
    return uint16_t(sign | uint32_t(std::nearbyint(std::fabs(f) * 16777216.0f)));
  uint32_t h = (mag - 0x38000000) >> 13;
  const uint32_t rest = mag & 0x1FFF;
  if (rest > 0x1000 || (rest == 0x1000 && (h & 1))) h += 1;
  return uint16_t(sign | h);
#endif
}

// Loading: n of llama.cpp's Q4_K super-blocks (144 bytes: float16 d and dmin, 12 bytes of 6-bit
// sc_j and m_j, 128 bytes of q; w = d sc_j q - dmin m_j over eight groups of 32) -> the 4-bit
// layout with its q as stored and scale d sc_j, minimum -dmin m_j rounded to float16:
// bridge/gguf/int4.py's from_q4_k_blocks with float16 scales, the same bytes. packed: 128 bytes
// a super-block; scale, low: 8 float16 a super-block. sums[0] += the squared change the rounding
// makes, sums[1] += the squared weights (from each group's sums of q and q^2, in double). Returns
// 0 where a scale or minimum is not finite in float16, else 1.
extern "C" int bridge_from_q4_k_blocks(const uint8_t* blocks, int64_t n, uint8_t* packed,
                                          uint16_t* scale, uint16_t* low, double* sums) {
  double change = 0, norm = 0;
  int finite = 1;
  for (int64_t i = 0; i < n; ++i) {
    const uint8_t* b = blocks + i * 144;
    uint16_t bits[2];
    std::memcpy(bits, b, 4);
    const float d = HalfToFloat(bits[0]), dmin = HalfToFloat(bits[1]);
    // each run of 32 bytes: 64 weights, group 2r's q in the low nibbles and 2r + 1's in the
    // high ones; repacked as Q4_0's 16 bytes are (the layout's byte k holds inputs 2k and 2k + 1),
    // and each group's sums of q and q^2 taken on the way
    int q_sums[8], q_squares[8];
    for (int r = 0; r < 4; ++r) {
      const uint8_t* qs = b + 16 + r * 32;
      uint8_t* out = packed + i * 128 + r * 32;
#if defined(__SSSE3__)
      const __m128i low4 = _mm_set1_epi8(0x0F), zero = _mm_setzero_si128();
      const __m128i a = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
      const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs + 16));
      const __m128i a_lo = _mm_and_si128(a, low4), a_hi = _mm_and_si128(_mm_srli_epi16(a, 4), low4);
      const __m128i c_lo = _mm_and_si128(c, low4), c_hi = _mm_and_si128(_mm_srli_epi16(c, 4), low4);
      // pairs of neighbours: even bytes | odd bytes << 4, the first 8 from each half's low
      // nibbles, then from its high ones
      const __m128i evens = _mm_setr_epi8(0, 2, 4, 6, 8, 10, 12, 14, -1, -1, -1, -1, -1, -1, -1, -1);
      const __m128i odds = _mm_setr_epi8(1, 3, 5, 7, 9, 11, 13, 15, -1, -1, -1, -1, -1, -1, -1, -1);
      auto pairs = [&](__m128i x) {  // 8 bytes: x[2k] | x[2k + 1] << 4
        return _mm_or_si128(_mm_shuffle_epi8(x, evens), _mm_slli_epi16(_mm_shuffle_epi8(x, odds), 4));
      };
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out), _mm_unpacklo_epi64(pairs(a_lo), pairs(c_lo)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 16),
                       _mm_unpacklo_epi64(pairs(a_hi), pairs(c_hi)));
      const __m128i ones = _mm_set1_epi16(1);
      auto sum_of = [&](__m128i x, __m128i y) {  // the 32 bytes' sum
        const __m128i s = _mm_add_epi64(_mm_sad_epu8(x, zero), _mm_sad_epu8(y, zero));
        return _mm_cvtsi128_si32(s) + _mm_extract_epi16(s, 4);
      };
      auto squares_of = [&](__m128i x, __m128i y) {  // the 32 bytes' squares summed
        const __m128i s = _mm_madd_epi16(_mm_add_epi16(_mm_maddubs_epi16(x, x), _mm_maddubs_epi16(y, y)), ones);
        const __m128i t = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
        return _mm_cvtsi128_si32(_mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1)));
      };
      q_sums[2 * r] = sum_of(a_lo, c_lo), q_squares[2 * r] = squares_of(a_lo, c_lo);
      q_sums[2 * r + 1] = sum_of(a_hi, c_hi), q_squares[2 * r + 1] = squares_of(a_hi, c_hi);
#else
      q_sums[2 * r] = q_sums[2 * r + 1] = q_squares[2 * r] = q_squares[2 * r + 1] = 0;
      for (int k = 0; k < 32; ++k) {
        const int lo = qs[k] & 0x0F, hi = qs[k] >> 4;
        q_sums[2 * r] += lo, q_squares[2 * r] += lo * lo;
        q_sums[2 * r + 1] += hi, q_squares[2 * r + 1] += hi * hi;
      }
      for (int k = 0; k < 16; ++k) {
        const uint8_t x = qs[2 * k], y = qs[2 * k + 1];
        out[k] = uint8_t((x & 0x0F) | ((y & 0x0F) << 4));
        out[16 + k] = uint8_t((x >> 4) | (y & 0xF0));
      }
#endif
    }
    const uint8_t* q6 = b + 4;  // sc_j, m_j: llama.cpp's get_scale_min_k4
    for (int j = 0; j < 8; ++j) {
      int sc, m;
      ScaleMin(q6, j, &sc, &m);
      const float d_exact = d * float(sc), m_exact = -(dmin * float(m));  // exact in float32
      const uint16_t dh = FloatToHalf(d_exact), mh = FloatToHalf(m_exact);
      scale[i * 8 + j] = dh, low[i * 8 + j] = mh;
      if ((dh & 0x7C00) == 0x7C00 || (mh & 0x7C00) == 0x7C00) finite = 0;
      const double de = d_exact, me = m_exact;
      const double dd = double(HalfToFloat(dh)) - de, dm = double(HalfToFloat(mh)) - me;
      const double s1 = q_sums[j], s2 = q_squares[j];
      change += dd * dd * s2 + 2 * dd * dm * s1 + 32 * dm * dm;
      norm += de * de * s2 + 2 * de * me * s1 + 32 * me * me;
    }
  }
  if (finite) sums[0] += change, sums[1] += norm;
  return finite;
}

// -- a GGUF array of strings: where each ends ---------------------------------------------------
//
// n strings stored one after another from data[at], each its uint64 length (little-endian) then
// its bytes: ends[k] is the offset just past string k. A vocabulary of 49,152 tokens and as many
// merges took Python's loop 60 ms to walk (SmolLM2's file); its bytes are then decoded at once
// (bridge.gguf.container). Returns 0, or -1 where a string runs past `size` (nothing read there).
extern "C" int bridge_string_ends(const uint8_t* data, int64_t size, int64_t at, int64_t n,
                                  int64_t* ends) {
  for (int64_t k = 0; k < n; ++k) {
    if (at < 0 || at > size - 8) return -1;
    uint64_t length;
    std::memcpy(&length, data + at, sizeof(length));
    if (length > static_cast<uint64_t>(size - at - 8)) return -1;
    at += 8 + static_cast<int64_t>(length);
    ends[k] = at;
  }
  return 0;
}
