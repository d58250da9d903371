// Few-row matmuls for XLA:CPU, called through the XLA FFI (jax_llama/kernels/__init__.py builds
// and registers this file; jax_llama.model.Linear calls it for decoding).
//
//   y (M, O) = x (M, I) @ W (I, O)              W float32            "jax_llama_matvec_f32"
//   y (M, O) = (x (M, I) @ Q (I, O)) * s (O)    Q int8, s float32    "jax_llama_matvec_int8"
//
// Why: at decode time M is 1 to 8 and the matmul only reads its weights once. XLA:CPU has no
// fast path for that with int8 weights (it converts the whole weight to float first, writing a
// float copy) and reaches about 75% of read bandwidth with float32 ones. Here each weight is
// read once, converted in registers and multiplied into M rows of float32 accumulators, the
// columns split between XLA's own intra-op threads.
//
// Arithmetic: every output is one float32 sum over i = 0 .. I-1 in order, a fused multiply-add
// per term; the int8 scale multiplies the finished sum, as jax_llama.model.int8_matmul does.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <memory>
#include <thread>

#include "xla/ffi/api/ffi.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define JL_AVX2 1
#endif

namespace ffi = xla::ffi;

namespace {

// Columns given to a thread at a time: a multiple of every vector block below.
constexpr int64_t kChunk = 64;

template <typename W>
struct Job {
  const float* x;
  const W* w;
  const float* scale;  // nullptr for float32 weights
  float* y;
  int64_t M, I, O, chunks;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

#ifdef JL_AVX2
inline __m256 Load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 Load8(const int8_t* p) {
  __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
}

// R rows of x times V * 8 columns of W starting at column o: R * V accumulators.
template <int R, int V, typename W>
inline void Block(const Job<W>& j, int64_t m, int64_t o) {
  __m256 acc[R][V];
  for (int r = 0; r < R; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = _mm256_setzero_ps();
  const W* w = j.w + o;
  const float* x = j.x + m * j.I;
  for (int64_t i = 0; i < j.I; ++i, w += j.O) {
    __m256 wv[V];
    for (int v = 0; v < V; ++v) wv[v] = Load8(w + 8 * v);
    for (int r = 0; r < R; ++r) {
      __m256 xr = _mm256_broadcast_ss(x + r * j.I + i);
      for (int v = 0; v < V; ++v) acc[r][v] = _mm256_fmadd_ps(xr, wv[v], acc[r][v]);
    }
  }
  for (int r = 0; r < R; ++r) {
    float* y = j.y + (m + r) * j.O + o;
    for (int v = 0; v < V; ++v) {
      __m256 out = acc[r][v];
      if (j.scale) out = _mm256_mul_ps(out, _mm256_loadu_ps(j.scale + o + 8 * v));
      _mm256_storeu_ps(y + 8 * v, out);
    }
  }
}

// Columns [o0, o1), o1 - o0 a multiple of 8, for all M rows.
template <typename W>
void Columns(const Job<W>& j, int64_t o0, int64_t o1) {
  for (int64_t m = 0; m < j.M;) {
    int64_t rows = j.M - m;
    int64_t o = o0;
    if (rows >= 4) {
      for (; o + 16 <= o1; o += 16) Block<4, 2>(j, m, o);
      for (; o < o1; o += 8) Block<4, 1>(j, m, o);
      m += 4;
    } else if (rows >= 2) {
      for (; o + 32 <= o1; o += 32) Block<2, 4>(j, m, o);
      for (; o < o1; o += 8) Block<2, 1>(j, m, o);
      m += 2;
    } else {
      for (; o + 64 <= o1; o += 64) Block<1, 8>(j, m, o);
      for (; o < o1; o += 8) Block<1, 1>(j, m, o);
      m += 1;
    }
  }
}
#endif

// The portable path: any column range, any CPU.
template <typename W>
void ColumnsScalar(const Job<W>& j, int64_t o0, int64_t o1) {
  for (int64_t m = 0; m < j.M; ++m) {
    float* y = j.y + m * j.O;
    const float* x = j.x + m * j.I;
    for (int64_t o = o0; o < o1; ++o) y[o] = 0.0f;
    for (int64_t i = 0; i < j.I; ++i) {
      const W* w = j.w + i * j.O;
      for (int64_t o = o0; o < o1; ++o) y[o] = std::fma(x[i], static_cast<float>(w[o]), y[o]);
    }
    if (j.scale)
      for (int64_t o = o0; o < o1; ++o) y[o] *= j.scale[o];
  }
}

template <typename W>
void Chunk(const Job<W>& j, int64_t c) {
  int64_t o0 = c * kChunk, o1 = std::min(j.O, o0 + kChunk);
#ifdef JL_AVX2
  int64_t vec_end = o0 + (o1 - o0) / 8 * 8;
  Columns(j, o0, vec_end);
  if (vec_end < o1) ColumnsScalar(j, vec_end, o1);
#else
  ColumnsScalar(j, o0, o1);
#endif
}

// Take chunks until none is left; every thread (the caller and the helpers) runs this.
template <typename W>
void Work(Job<W>& j) {
  for (int64_t c; (c = j.next.fetch_add(1, std::memory_order_relaxed)) < j.chunks;) {
    Chunk(j, c);
    j.done.fetch_add(1, std::memory_order_release);
  }
}

template <typename W>
ffi::Error Run(ffi::ThreadPool pool, const float* x, const W* w, const float* scale, float* y,
               int64_t M, int64_t I, int64_t O) {
  auto job = std::make_shared<Job<W>>();
  job->x = x, job->w = w, job->scale = scale, job->y = y;
  job->M = M, job->I = I, job->O = O;
  job->chunks = (O + kChunk - 1) / kChunk;
  // A helper that starts late finds no chunk left and returns; the job outlives this call.
  int64_t helpers = std::min<int64_t>(pool.num_threads(), job->chunks - 1);
  for (int64_t h = 0; h < helpers; ++h) pool.Schedule([job] { Work(*job); });
  Work(*job);
  while (job->done.load(std::memory_order_acquire) < job->chunks) std::this_thread::yield();
  return ffi::Error::Success();
}

ffi::Error CheckShapes(ffi::Span<const int64_t> x, ffi::Span<const int64_t> w,
                       ffi::Span<const int64_t> y) {
  if (x.size() != 2 || w.size() != 2 || y.size() != 2 || x[1] != w[0] || y[0] != x[0] ||
      y[1] != w[1])
    return ffi::Error::InvalidArgument("matvec: expected x (M, I), w (I, O) and y (M, O)");
  return ffi::Error::Success();
}

ffi::Error MatvecF32(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                     ffi::ResultBuffer<ffi::F32> y) {
  if (auto e = CheckShapes(x.dimensions(), w.dimensions(), y->dimensions()); e.failure())
    return e;
  return Run(pool, x.typed_data(), w.typed_data(), static_cast<const float*>(nullptr),
             y->typed_data(), x.dimensions()[0], x.dimensions()[1], w.dimensions()[1]);
}

ffi::Error MatvecInt8(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> q,
                      ffi::Buffer<ffi::F32> scale, ffi::ResultBuffer<ffi::F32> y) {
  if (auto e = CheckShapes(x.dimensions(), q.dimensions(), y->dimensions()); e.failure())
    return e;
  if (scale.element_count() != q.dimensions()[1])
    return ffi::Error::InvalidArgument("matvec: int8 scale must hold one value per column");
  return Run(pool, x.typed_data(), q.typed_data(), scale.typed_data(), y->typed_data(),
             x.dimensions()[0], x.dimensions()[1], q.dimensions()[1]);
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxLlamaMatvecF32, MatvecF32,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxLlamaMatvecInt8, MatvecInt8,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

extern "C" int jax_llama_matvec_avx2() {
#ifdef JL_AVX2
  return 1;
#else
  return 0;
#endif
}
