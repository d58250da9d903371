// Decode kernels for XLA:CPU, called through the XLA FFI (jax_llama/kernels/__init__.py builds
// and registers this file; jax_llama.model calls it for decoding): few-row matmuls, and
// attention over a KV cache (at the end of the file).
//
//   y_k (M, O_k) = x (M, I) @ W_k (I, O_k)          W_k float32, k = 1.. (several weights that
//                                                   read the same x, one call)
//                                                                      "jax_llama_matvec_f32"
//   y_k (M, O_k) = (x @ Q_k (I, O_k)) * s_k (O_k)   Q_k int8, s_k float32, k = 1.. (or s_k
//                                                   (G, O_k): a row per group of I / G inputs)
//                                                                      "jax_llama_matvec_int8"
//   y (M, O) = (x (M, I) @ Q (O, I)^T) * s (O)     Q int8 stored a row per output, s float32
//                                                   (or (O, G)); a tied LM head: the embedding
//                                                                 "jax_llama_matvec_int8_rows"
//   y (M, O) = x (M, I) @ W (O, I)^T               the same, float32 "jax_llama_matvec_f32_rows"
//   y_k (M, O_k) = x @ (q_k * d_k + m_k)^T          4-bit q_k stored (O_k, I / 2), two weights a
//                                                   byte; d_k, m_k float32 (O_k, I / 32), k = 1..
//                                                                      "jax_llama_matvec_int4"
//   the same with x rounded to 8 bits per group of 32 and each group summed as integers
//   (JAX_LLAMA_INT4_ACTIVATIONS=int8)                              "jax_llama_matvec_int4_q8"
//   the same with x rounded to bfloat16 (JAX_LLAMA_INT4_ACTIVATIONS=bfloat16)
//                                                                  "jax_llama_matvec_int4_bf16"
//   the same for a prompt's many rows of x (bfloat16 pairs multiplied, AVX512_BF16)
//                                                                  "jax_llama_prompt_int4_bf16"
//   the int8 product for a prompt's rows of x rounded to bfloat16 (AVX512_BF16)
//                                                                  "jax_llama_prompt_int8_bf16"
//   out = softmax(q k^T / sqrt(H) + mask) v        k, v: layer l of the cache, read in place
//                                                                 "jax_llama_decode_attention"
//
// Why: at decode time M is 1 to 8 and the matmul reads its weights once, so its speed is how
// fast W streams in. XLA:CPU converts an int8 weight to float in a pass of its own. Here each
// weight is converted in a register and multiplied into M rows of float32 sums. For one or two
// rows of x a block of W is read R whole rows at a time, side by side, its sums kept in L1
// (RowsPass); for more, in strips of columns whose sums stay in registers for the whole block
// (Strip: 256 float32 or int8 weights of each row for one row of x, fewer for more).
//
// Work: the rows of W are cut into blocks of 64 (more for an LM head: BlockRows), and very wide
// W into column panels of kPanel; each (block, panel) is a unit that writes its own partial
// sums. A call that reads kShareBytes or more shares its units with this library's helper
// threads (Helpers, below) through an atomic counter; a smaller one runs on the calling thread
// alone.
//
// Arithmetic: within a block, each output is a float32 sum over the block's rows in order, one
// fused multiply-add per term; the block sums are then added in block order (what
// jax_llama.model._int8_dot_by_blocks does with XLA's dots), and the int8 scale multiplies the
// total (grouped scales: each group's sums are scaled into its block's in order, Unit). Nothing
// in that order depends on M or on the number of threads, so a row decodes to the
// same bits alone or beside others, on any machine with the same instruction set.
//
// Rows of Q (O, I) ("_rows"): each output is a dot product over one row of Q, read in order.
// Several rows are done at once (8 for one row of x, fewer for more) so that enough independent
// sums are in flight, and each weight vector is converted once for all M rows of x. Units are
// kUnitRows rows of Q, shared with the helpers from kShareBytes as above; outputs are
// independent, so there are no partial sums. An output is kLanes float32 sums (lane l over
// columns l, l + kLanes, ... in order, one fused multiply-add per term), added by a fixed tree
// (HorizontalSum), then the columns past the last full vector in order, then times the scale:
// again nothing depends on M, on the rows done together or on the threads.

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <thread>
#include <type_traits>
#include <vector>

#include "half.h"  // HalfToFloat, shared with the loads' passes (bridge/native/half.h)
#include "xla/ffi/api/ffi.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace ffi = xla::ffi;

namespace {

constexpr int64_t kBlockRows = 64;        // rows summed into one partial (INT8_BLOCK_ROWS)
constexpr int64_t kMaxPartial = 1 << 20;  // partial sums per row of x, at most (4 MB)
constexpr int64_t kPanel = 4096;          // columns of a unit (a row of W read whole up to this)
// Weight bytes a call must read before the helpers join it. A helper that is spinning (it was
// busy less than kSpinNs ago: a decode step's calls follow each other by tens of microseconds)
// joins within a microsecond, so sharing pays from a few hundred KB; one that sleeps takes tens of
// microseconds to wake, by which time the caller has done most of a small call alone (a late
// helper only finds fewer units). 64 KB: every projection of SmolLM2 but int8 k and v alone.
constexpr size_t kShareBytes = size_t{64} << 10;
// How long a helper spins after its last unit before it sleeps: longer than the gaps between a
// decode step's calls (XLA's small operations), short enough that an idle process stops burning
// a core within a millisecond.
constexpr int64_t kSpinNs = 300'000;
// How far ahead of what is being read a weight is asked for (software prefetch, one request per
// cache line). The rows kernel reads R rows at a time, each a stream too short (SmolLM2: 9 cache
// lines) for the CPU's prefetchers to pick up: without it one Zen 5 core read SmolLM2's head at
// about half the speed (8 to 32 KB ahead were about as good). (The (I, O) kernel's strips ask
// for each row's next strip instead: Strip.)
constexpr int64_t kPrefetchBytes = 16 << 10;
constexpr int64_t kCacheLine = 64;
constexpr int64_t kGroup4 = 32;  // 4-bit weights: inputs per scale and minimum (bridge.int4.GROUP)

// Rows per block: 64, or a larger multiple of 64 where W is so big that its partial sums would
// pass kMaxPartial per row of x (an LM head). A function of W's shape only, never of M.
int64_t BlockRows(int64_t I, int64_t O) {
  int64_t wanted = (I * O + kMaxPartial - 1) / kMaxPartial;
  return std::max(kBlockRows, (wanted + kBlockRows - 1) / kBlockRows * kBlockRows);
}

// -- vectors of float32: 16 lanes (AVX-512), 8 (AVX2 + FMA) or 1 (any CPU) ---------------------
#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
using Vec = __m512;
inline Vec Load(const float* p) { return _mm512_loadu_ps(p); }
inline Vec Load(const int8_t* p) {
  return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
}
inline void Store(float* p, Vec v) { _mm512_storeu_ps(p, v); }
inline Vec Splat(float v) { return _mm512_set1_ps(v); }
inline Vec Fma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
inline Vec Mul(Vec a, Vec b) { return _mm512_mul_ps(a, b); }
inline Vec Add(Vec a, Vec b) { return _mm512_add_ps(a, b); }
inline float HorizontalSum(Vec v) { return _mm512_reduce_add_ps(v); }  // a fixed tree: 8, 4, 2, 1
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int64_t kLanes = 8;
using Vec = __m256;
inline Vec Load(const float* p) { return _mm256_loadu_ps(p); }
inline Vec Load(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline void Store(float* p, Vec v) { _mm256_storeu_ps(p, v); }
inline Vec Splat(float v) { return _mm256_set1_ps(v); }
inline Vec Fma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
inline Vec Mul(Vec a, Vec b) { return _mm256_mul_ps(a, b); }
inline Vec Add(Vec a, Vec b) { return _mm256_add_ps(a, b); }
inline float HorizontalSum(Vec v) {  // a fixed tree: lanes l + 4, then l + 2, then l + 1
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
#else
constexpr int64_t kLanes = 1;
#endif
// The scalar forms, for the columns past the last full vector (and for CPUs without either):
// the same operations one lane at a time, so a column's bits do not depend on where it falls.
inline float LoadS(const float* p) { return *p; }
inline float LoadS(const int8_t* p) { return static_cast<float>(*p); }
#if !defined(__AVX512F__) && !(defined(__AVX2__) && defined(__FMA__))
using Vec = float;
inline Vec Load(const float* p) { return *p; }
inline Vec Load(const int8_t* p) { return static_cast<float>(*p); }
inline void Store(float* p, Vec v) { *p = v; }
inline Vec Splat(float v) { return v; }
inline Vec Fma(Vec a, Vec b, Vec c) { return std::fma(a, b, c); }
inline Vec Mul(Vec a, Vec b) { return a * b; }
inline Vec Add(Vec a, Vec b) { return a + b; }
inline float HorizontalSum(Vec v) { return v; }
#endif

// One weight of a call: W (I, O), its scale (int8) and output, cut into units of
// (block of rows, panel of columns); its partial sums are blocks x M x O floats of the scratch.
template <typename W>
struct Part {
  const W* w;
  const float* scale;  // nullptr for float32 weights
  float* y;
  float* partial;
  int64_t O, block_rows, blocks, panels, first_unit;
  // int8 with a scale per group of group_rows inputs (scale (I / group_rows, O)): each group's
  // sums scaled into the block's in the unit (GroupedUnit); 0: one scale per output, which
  // multiplies the block sums' total (Reduce)
  int64_t group_rows = 0;
};

// x (M, I) times every part's weight; units numbered part after part.
template <typename W>
struct Job {
  const float* x;
  int64_t M, I, units = 0;
  std::vector<Part<W>> parts;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

// Registers that hold vectors: 32 with AVX-512, 16 with AVX2 (and a plain build's count of floats).
#if defined(__AVX512F__)
constexpr int kRegisters = 32;
#else
constexpr int kRegisters = 16;
#endif

// Columns of a strip, in vectors (a power of 2): its M x n sums fill at most half the registers.
constexpr int StripVectors(int M) {
  int n = 1;
  while (2 * n * M <= kRegisters / 2) n *= 2;
  return n;
}

// Columns [o, o + NV * kLanes) of rows [i0, i1) of W (a block) into M rows of sums held in
// registers, stored to acc[m, o ...] at the end: acc[m, o] = x[m, i0] * w[i0, o], then
// fma(x[m, i], w[i, o], acc[m, o]) for each later row in order. Each row's piece of the strip is
// read whole (NV * kLanes weights in a row) and the same row's next strip is asked for meanwhile.
// Against reading each row whole into accumulators in memory (stored and loaded again for every
// weight vector), a chain of SmolLM2's 210 float32 projections streamed 34-35 against 30-31 GB/s
// (standalone, 2 threads, 2-core AMD EPYC Zen 5; a plain sum of the same bytes 35). The same sums
// in the same order: the bits do not change. For one or two rows of x RowsPass is faster still.
template <int M, int NV, typename W>
inline void Strip(const float* x, int64_t I, const W* w, int64_t O, int64_t i0, int64_t i1,
                  int64_t o, float* acc) {
  Vec a[M][NV], xv[M];
  const W* row = w + i0 * O + o;
  for (int m = 0; m < M; ++m) xv[m] = Splat(x[m * I + i0]);
  for (int k = 0; k < NV; ++k) {
    Vec wv = Load(row + k * kLanes);
    for (int m = 0; m < M; ++m) a[m][k] = Mul(xv[m], wv);
  }
  constexpr int64_t kBytes = NV * kLanes * int64_t{sizeof(W)};
  for (int64_t i = i0 + 1; i < i1; ++i) {
    row += O;
    const char* next = reinterpret_cast<const char*>(row) + kBytes;
    for (int64_t b = 0; b < kBytes; b += kCacheLine) __builtin_prefetch(next + b);
    for (int m = 0; m < M; ++m) xv[m] = Splat(x[m * I + i]);
    for (int k = 0; k < NV; ++k) {
      Vec wv = Load(row + k * kLanes);
      for (int m = 0; m < M; ++m) a[m][k] = Fma(xv[m], wv, a[m][k]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int k = 0; k < NV; ++k) Store(acc + m * O + o + k * kLanes, a[m][k]);
}

// Rows [i, i + R) of W, columns [o0, o1) (whole vectors), into M rows of sums in memory (acc,
// the block's partial sums, which stay in L1): acc[m, o] = x[m, i0] * w[i0, o] when i is the
// block's first row, then fma(x[m, i], w[i, o], acc[m, o]) for each row in order: the strips'
// sums in the strips' order, so the same bits. The R rows are read whole, side by side (R
// streams through one contiguous stretch of W) while the next R rows are asked for.
template <int M, int R, bool Ahead, typename W>
inline void RowsPass(const float* x, int64_t I, const W* w, int64_t O, int64_t i0, int64_t i,
                     int64_t o0, int64_t o1, float* acc) {
  Vec xv[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) xv[r][m] = Splat(x[m * I + i + r]);
  const W* rows = w + i * O;
  const char* next = reinterpret_cast<const char*>(rows + R * O);
  const bool first = i == i0;
  for (int64_t o = o0; o + kLanes <= o1; o += kLanes) {
    // the next R rows, at R times the pace these are read: all of them by the pass's end
    const int64_t ahead = (o - o0) * R * int64_t{sizeof(W)};
    if (Ahead && (ahead & (kCacheLine - 1)) < R * kLanes * int64_t{sizeof(W)})
      for (int64_t b = 0; b < R * kLanes * int64_t{sizeof(W)}; b += kCacheLine)
        __builtin_prefetch(next + ahead + b);
    Vec a[M];
    int r = 0;
    if (first) {
      const Vec wv = Load(rows + o);
      for (int m = 0; m < M; ++m) a[m] = Mul(xv[0][m], wv);
      r = 1;
    } else {
      for (int m = 0; m < M; ++m) a[m] = Load(acc + m * O + o);
    }
    for (; r < R; ++r) {
      const Vec wv = Load(rows + r * O + o);
      for (int m = 0; m < M; ++m) a[m] = Fma(xv[r][m], wv, a[m]);
    }
    for (int m = 0; m < M; ++m) Store(acc + m * O + o, a[m]);
  }
}

// Rows of W read together by RowsPass: R x M broadcasts of x held beside M sums. RowsPass stores
// and reloads M sums every R weight vectors, so it serves up to kPassMaxRows rows of x; with
// more, Strip's sums in registers are faster. SmolLM2's float32 decode (2-core AMD EPYC Zen 4,
// alternating processes): batch 1 41-44 tokens/s against 33-34 in strips, batch 2 76-83 against
// 66-72; with RowsPass at batch 8 it fell from 187 to 142-159 (int8 from 341-360 to 183-192).
template <typename W>
constexpr bool WideFloatPass(int M) {
  return M == 1 && std::is_same_v<W, float> && kRegisters == 32;
}
template <typename W>
constexpr int PassRows(int M) {
  return WideFloatPass<W>(M) ? 16 : M == 1 ? 8 : M == 2 ? 4 : M <= 4 ? 2 : 1;
}
template <typename W>
constexpr bool PassAhead(int M) { return !WideFloatPass<W>(M); }
constexpr int kPassMaxRows = 2;

// Rows [i0, i1) of W, columns [o0, o1), into M rows of sums at acc (acc[m, o] = x[m, i0] w[i0,
// o], then fma(x[m, i], w[i, o], acc[m, o]) for each later row in order).
template <int M, typename W>
void Sums(const Job<W>& j, const Part<W>& p, int64_t i0, int64_t i1, int64_t o0, int64_t o1,
          float* acc) {
  const int64_t vectors_end = o0 + (o1 - o0) / kLanes * kLanes;
  if constexpr (M <= kPassMaxRows) {
    constexpr int R = PassRows<W>(M);
    constexpr bool ahead = PassAhead<W>(M);
    int64_t i = i0;
    for (; i + R <= i1; i += R)
      RowsPass<M, R, ahead>(j.x, j.I, p.w, p.O, i0, i, o0, vectors_end, acc);
    for (; i < i1; ++i) RowsPass<M, 1, ahead>(j.x, j.I, p.w, p.O, i0, i, o0, vectors_end, acc);
  } else {
    constexpr int NV = StripVectors(M);
    int64_t o = o0;
    for (; o + NV * kLanes <= vectors_end; o += NV * kLanes)
      Strip<M, NV>(j.x, j.I, p.w, p.O, i0, i1, o, acc);
    for (; o < vectors_end; o += kLanes) Strip<M, 1>(j.x, j.I, p.w, p.O, i0, i1, o, acc);
  }
  // The columns past the last full vector, one at a time in the same order.
  for (int64_t o = vectors_end; o < o1; ++o)
    for (int64_t i = i0; i < i1; ++i) {
      float wo = LoadS(p.w + i * p.O + o);
      for (int m = 0; m < M; ++m) {
        float* a = acc + m * p.O + o;
        *a = i == i0 ? j.x[m * j.I + i] * wo : std::fma(j.x[m * j.I + i], wo, *a);
      }
    }
}

// A unit: its block's sums (Sums); with grouped scales, each group's sums apart (in this thread's
// scratch) scaled into the block's, group after group in input order:
//   acc = sums_g0 * s_g0, then fma(sums_g, s_g, acc)
// so a block sum is already scaled, and an output's arithmetic depends on neither M nor the threads.
template <int M, typename W>
void Unit(const Job<W>& j, const Part<W>& p, int64_t u) {
  int64_t b = u / p.panels, c = u % p.panels;
  int64_t i0 = b * p.block_rows, i1 = std::min(j.I, i0 + p.block_rows);
  int64_t o0 = c * kPanel, o1 = std::min(p.O, o0 + kPanel);
  float* acc = p.partial + b * j.M * p.O;
  if (p.group_rows == 0) return Sums<M>(j, p, i0, i1, o0, o1, acc);
  thread_local std::vector<float> group;
  if (group.size() < size_t(M * p.O)) group.resize(M * p.O);
  for (int64_t g0 = i0; g0 < i1; g0 += p.group_rows) {
    Sums<M>(j, p, g0, std::min(i1, g0 + p.group_rows), o0, o1, group.data());
    const float* s = p.scale + g0 / p.group_rows * p.O;
    for (int m = 0; m < M; ++m) {
      float* a = acc + m * p.O;
      const float* t = group.data() + m * p.O;
      int64_t o = o0;
      for (; o + kLanes <= o1; o += kLanes)
        Store(a + o, g0 == i0 ? Mul(Load(t + o), Load(s + o))
                              : Fma(Load(t + o), Load(s + o), Load(a + o)));
      for (; o < o1; ++o) a[o] = g0 == i0 ? t[o] * s[o] : std::fma(t[o], s[o], a[o]);
    }
  }
}

template <typename W>
void RunUnit(const Job<W>& j, int64_t u) {
  size_t k = 0;
  while (k + 1 < j.parts.size() && u >= j.parts[k + 1].first_unit) ++k;
  const Part<W>& p = j.parts[k];
  u -= p.first_unit;
  switch (j.M) {
    case 1: return Unit<1>(j, p, u);
    case 2: return Unit<2>(j, p, u);
    case 3: return Unit<3>(j, p, u);
    case 4: return Unit<4>(j, p, u);
    case 5: return Unit<5>(j, p, u);
    case 6: return Unit<6>(j, p, u);
    case 7: return Unit<7>(j, p, u);
    default: return Unit<8>(j, p, u);
  }
}

template <typename W>
struct RowsJob;  // the rows kernel's job (below); Work runs its units too
template <typename W>
void RunUnit(const RowsJob<W>& j, int64_t u);
struct AttentionJob;  // attention over a KV cache (below)
void RunUnit(const AttentionJob& j, int64_t u);

// Take units until none is left; every thread (the caller and the helpers) runs this.
template <typename J>
void Work(J& job) {
  for (int64_t u; (u = job.next.fetch_add(1, std::memory_order_relaxed)) < job.units;) {
    RunUnit(job, u);
    job.done.fetch_add(1, std::memory_order_release);
  }
}

// -- helpers: this library's threads, which take units of the calls the caller shares --------
// XLA's intra-op threads sleep between tasks and took about 25 us each to wake (2-core VM), as
// long as a SmolLM2 projection takes to read: shared with them, a decode step's calls were no
// faster than on one thread. These helpers spin for kSpinNs after their last unit instead, as
// llama.cpp's threads do, then sleep on a condition variable. A call is published as (generation,
// job, how to work on it); a helper that sees a new generation takes a reference to the job and
// works on it until no unit is left. The caller works too and never waits for a helper to come:
// it waits only for units a helper has taken to finish, so a call completes with no helper at all.
struct Helpers {
  std::mutex mu;
  std::condition_variable wake;
  std::atomic<uint64_t> generation{0};
  std::atomic<int> sleeping{0};
  std::shared_ptr<void> job;  // the last call shared (kept until the next: no unit is left in it)
  void (*work)(void*) = nullptr;
  int64_t threads = 0;
};

inline int64_t NowNs() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch()).count();
}

inline void Pause() {
#if defined(__x86_64__)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#else
  std::this_thread::yield();
#endif
}

void HelperLoop(Helpers* h) {
  uint64_t seen = 0;
  for (;;) {
    const int64_t until = NowNs() + kSpinNs;
    while (h->generation.load(std::memory_order_acquire) == seen && NowNs() < until)
      for (int k = 0; k < 16; ++k) Pause();
    std::shared_ptr<void> job;
    void (*work)(void*);
    {
      std::unique_lock<std::mutex> lock(h->mu);
      if (h->generation.load(std::memory_order_acquire) == seen) {
        h->sleeping.fetch_add(1);
        h->wake.wait(lock, [&] { return h->generation.load(std::memory_order_acquire) != seen; });
        h->sleeping.fetch_sub(1);
      }
      seen = h->generation.load(std::memory_order_acquire);
      job = h->job;
      work = h->work;
    }
    if (job) work(job.get());
  }
}

// Helper threads to start: $JAX_LLAMA_KERNEL_THREADS - 1 if set (1: the caller alone), else one
// fewer than the CPUs this process may run on, at most 7 (a few cores saturate memory bandwidth).
int64_t HelperCount() {
  if (const char* v = std::getenv("JAX_LLAMA_KERNEL_THREADS"); v && *v)
    return std::max<int64_t>(0, std::atoll(v) - 1);
  int64_t cpus = std::thread::hardware_concurrency();
#if defined(__linux__)
  cpu_set_t set;
  if (sched_getaffinity(0, sizeof(set), &set) == 0) cpus = CPU_COUNT(&set);
#endif
  return std::clamp<int64_t>(cpus - 1, 0, 7);
}

// This process's helpers, started on first use (a forked child starts its own: a fork copies
// none of the parent's threads, and perhaps a locked mutex).
Helpers* GetHelpers() {
  static std::mutex start;
  static Helpers* helpers = nullptr;
  static pid_t owner = 0;
  std::lock_guard<std::mutex> lock(start);
  if (helpers == nullptr || owner != getpid()) {
    helpers = new Helpers;  // never freed: its threads live as long as the process
    owner = getpid();
    helpers->threads = HelperCount();
    for (int64_t k = 0; k < helpers->threads; ++k) std::thread(HelperLoop, helpers).detach();
  }
  return helpers;
}

template <typename J>
void WorkOn(void* job) { Work(*static_cast<J*>(job)); }

// Run a job's units on the calling thread, with the helpers joining when `share`; returns when
// every unit is done. What the units write may belong to the caller: a helper that starts late
// finds no unit left and touches nothing.
template <typename J>
void RunUnits(const std::shared_ptr<J>& job, bool share) {
  if (share && job->units > 1) {
    Helpers* h = GetHelpers();
    if (h->threads > 0) {
      {
        std::lock_guard<std::mutex> lock(h->mu);
        h->job = job;
        h->work = &WorkOn<J>;
        h->generation.fetch_add(1, std::memory_order_release);
      }
      if (h->sleeping.load() > 0) h->wake.notify_all();
    }
  }
  Work(*job);
  while (job->done.load(std::memory_order_acquire) < job->units) std::this_thread::yield();
}

// A part's output: its block sums added in block order, times its scale (when it has one per
// output; grouped scales were applied in the units).
template <typename W>
void Reduce(const Part<W>& p, int64_t M) {
  const int64_t O = p.O;
  for (int64_t m = 0; m < M; ++m) {
    const float* first = p.partial + m * O;
    float* out = p.y + m * O;
    int64_t o = 0;
    for (; o + kLanes <= O; o += kLanes) {
      Vec s = Load(first + o);
      for (int64_t b = 1; b < p.blocks; ++b) s = Add(s, Load(first + b * M * O + o));
      Store(out + o, p.scale && !p.group_rows ? Mul(s, Load(p.scale + o)) : s);
    }
    for (; o < O; ++o) {
      float s = first[o];
      for (int64_t b = 1; b < p.blocks; ++b) s = s + first[b * M * O + o];
      out[o] = p.scale && !p.group_rows ? s * p.scale[o] : s;
    }
  }
}

// y_k = x @ W_k (times s_k) for each part k; the units shared with the helpers when the call
// reads at least kShareBytes of weights.
template <typename W>
ffi::Error Run(std::shared_ptr<Job<W>> job) {
  const int64_t M = job->M, I = job->I;
  if (M > 8) return ffi::Error::InvalidArgument("matvec: at most 8 rows");
  size_t floats = 0, bytes = 0;
  for (Part<W>& p : job->parts) {
    bytes += I * p.O * sizeof(W);
    if (I == 0) std::fill(p.y, p.y + M * p.O, 0.0f);
    if (M == 0 || I == 0 || p.O == 0) p.blocks = p.panels = 0;
    p.first_unit = job->units;
    job->units += p.blocks * p.panels;
    floats += p.blocks * M * p.O;
  }
  // The partial sums live in the caller's scratch, which outlives the units (RunUnits).
  thread_local std::vector<float> scratch;
  if (scratch.size() < floats) scratch.resize(floats);
  float* free = scratch.data();
  for (Part<W>& p : job->parts) p.partial = free, free += p.blocks * M * p.O;
  RunUnits(job, bytes >= kShareBytes);
  for (const Part<W>& p : job->parts)
    if (p.blocks > 0) Reduce(p, M);
  return ffi::Error::Success();
}

template <typename W>
Part<W> MakePart(const W* w, const float* scale, float* y, int64_t I, int64_t O,
                 int64_t group_rows = 0) {
  Part<W> p{w, scale, y, nullptr, O, BlockRows(I, O), 0, 0, 0};
  p.group_rows = group_rows;
  if (group_rows > 0)  // whole groups a block
    p.block_rows = (p.block_rows + group_rows - 1) / group_rows * group_rows;
  p.blocks = (I + p.block_rows - 1) / p.block_rows;
  p.panels = (O + kPanel - 1) / kPanel;
  return p;
}

bool Matches(ffi::Span<const int64_t> x, ffi::Span<const int64_t> w, ffi::Span<const int64_t> y) {
  return x.size() == 2 && w.size() == 2 && y.size() == 2 && x[1] == w[0] && y[0] == x[0] &&
         y[1] == w[1];
}

// x, then w_k for each weight k (float32) or (q_k, s_k) (int8); one output y_k each: weights that
// share their input (q, k and v; gate and up) are one call, one set of units for the helpers.
template <typename W>
ffi::Error MatvecMany(ffi::Buffer<ffi::F32> x, ffi::RemainingArgs args,
                      ffi::RemainingRets rets) {
  constexpr bool kScaled = std::is_same_v<W, int8_t>;
  constexpr size_t kArgs = kScaled ? 2 : 1;  // arguments per weight
  if (rets.size() == 0 || args.size() != kArgs * rets.size())
    return ffi::Error::InvalidArgument(kScaled ? "matvec: expected x, then (q, scale) per output"
                                               : "matvec: expected x, then w per output");
  using WBuffer = ffi::Buffer<kScaled ? ffi::S8 : ffi::F32>;
  auto job = std::make_shared<Job<W>>();
  job->x = x.typed_data(), job->M = x.dimensions()[0], job->I = x.dimensions()[1];
  for (size_t k = 0; k < rets.size(); ++k) {
    auto w = args.get<WBuffer>(kArgs * k);
    auto y = rets.get<ffi::Buffer<ffi::F32>>(k);
    if (!w.has_value() || !y.has_value())
      return ffi::Error::InvalidArgument(kScaled ? "matvec: int8 weights and float32 outputs"
                                                 : "matvec: float32 weights and outputs");
    if (!Matches(x.dimensions(), w->dimensions(), (*y)->dimensions()))
      return ffi::Error::InvalidArgument("matvec: expected x (M, I), w (I, O) and y (M, O)");
    const float* scale = nullptr;
    int64_t group_rows = 0;
    if constexpr (kScaled) {
      auto s = args.get<ffi::Buffer<ffi::F32>>(kArgs * k + 1);
      if (!s.has_value()) return ffi::Error::InvalidArgument("matvec: float32 scales");
      const int64_t O = w->dimensions()[1], n = s->element_count();
      const int64_t G = O > 0 ? n / O : 0;  // groups of inputs, each with a row of scales
      if (O == 0 ? n != 0 : (n % O != 0 || G == 0 || job->I % G != 0))
        return ffi::Error::InvalidArgument(
            "matvec: int8 scales must be (G, O), G dividing the inputs: one row per group");
      if (G > 1) group_rows = job->I / G;
      scale = s->typed_data();
    }
    job->parts.push_back(MakePart(w->typed_data(), scale, (*y)->typed_data(), job->I,
                                  w->dimensions()[1], group_rows));
  }
  return Run(job);
}

ffi::Error MatvecF32(ffi::Buffer<ffi::F32> x, ffi::RemainingArgs args,
                     ffi::RemainingRets rets) {
  return MatvecMany<float>(x, args, rets);
}

ffi::Error MatvecInt8(ffi::Buffer<ffi::F32> x, ffi::RemainingArgs args,
                      ffi::RemainingRets rets) {
  return MatvecMany<int8_t>(x, args, rets);
}

// -- rows of Q (O, I): y[m, o] = s[o] * (x[m, :] . Q[o, :]) -----------------------------------

constexpr int64_t kUnitRows = 512;  // rows of Q per unit (288 KB of SmolLM2's LM head)
// Rows of Q dotted at once with M rows of x: 6 to 8 sums in flight (of one FMA chain each), and
// R * M accumulators and R weight vectors held in registers (16 with AVX2, 32 with AVX-512).
constexpr int RowsAtOnce(int M) {
  return M == 1 ? 8 : M == 2 ? 4 : 2 * M + 4 <= kRegisters ? 2 : 1;
}

template <typename W>
struct RowsJob {
  const float* x;
  const W* q;
  const float* scale;  // nullptr for float32 weights
  float* y;
  int64_t M, I, O, units = 0;
  // int8 with scales (O, I / group): inputs per scale, a multiple of kLanes; 0: one a row
  int64_t group = 0;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

// y[m, o + r] for m < M, r < R: rows o .. o + R - 1 of Q, each read in order, each weight vector
// converted once for the M rows of x. Each of the R * M outputs is computed alone (the order of
// the header), so its bits do not depend on R or M.
template <int M, int R, typename W>
inline void Dots(const RowsJob<W>& j, int64_t o) {
  const int64_t I = j.I;
  const float* x = j.x;
  const W* q = j.q + o * I;
  Vec acc[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = Splat(0.0f);
  // The R rows are R * I weights in a row, read R * kLanes a step: ask for what lies
  // kPrefetchBytes past the step's place in them (never past Q's last byte).
  const char* base = reinterpret_cast<const char*>(j.q);
  constexpr int64_t kSize = sizeof(W);
  const int64_t ahead = o * I * kSize + kPrefetchBytes, last = j.O * I * kSize - 1;
  // the lanes' sums of inputs [i0, i1) into acc (or, grouped, into t, then scaled into acc)
  auto run = [&](int64_t i0, int64_t i1, Vec (&into)[R][M]) {
    for (int64_t i = i0; i < i1; i += kLanes) {
      for (int64_t b = 0; b < R * kLanes * kSize; b += kCacheLine)
        __builtin_prefetch(base + std::min(ahead + R * i * kSize + b, last));
      Vec wv[R];
      for (int r = 0; r < R; ++r) wv[r] = Load(q + r * I + i);
      for (int m = 0; m < M; ++m) {
        Vec xv = Load(x + m * I + i);
        for (int r = 0; r < R; ++r) into[r][m] = Fma(xv, wv[r], into[r][m]);
      }
    }
  };
  const int64_t i = j.group ? I : I / kLanes * kLanes;  // grouped: whole vectors (usable_rows)
  if (j.group == 0) {
    run(0, i, acc);
  } else {  // each group's lanes summed apart, then times its scale: acc = fma(t, s_g, acc)
    const int64_t G = I / j.group;
    for (int64_t g = 0; g < G; ++g) {
      Vec t[R][M];
      for (int r = 0; r < R; ++r)
        for (int m = 0; m < M; ++m) t[r][m] = Splat(0.0f);
      run(g * j.group, (g + 1) * j.group, t);
      for (int r = 0; r < R; ++r) {
        const Vec sg = Splat(j.scale[(o + r) * G + g]);
        for (int m = 0; m < M; ++m) acc[r][m] = Fma(t[r][m], sg, acc[r][m]);
      }
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) {
      float sum = HorizontalSum(acc[r][m]);
      for (int64_t k = i; k < I; ++k) sum = std::fma(x[m * I + k], LoadS(q + r * I + k), sum);
      j.y[m * j.O + o + r] = j.scale && !j.group ? sum * j.scale[o + r] : sum;
    }
}

template <int M, typename W>
void RowsUnit(const RowsJob<W>& j, int64_t u) {
  constexpr int R = RowsAtOnce(M);
  int64_t o = u * kUnitRows, o1 = std::min(j.O, o + kUnitRows);
  for (; o + R <= o1; o += R) Dots<M, R>(j, o);
  for (; o < o1; ++o) Dots<M, 1>(j, o);
}

template <typename W>
void RunUnit(const RowsJob<W>& j, int64_t u) {
  switch (j.M) {
    case 1: return RowsUnit<1>(j, u);
    case 2: return RowsUnit<2>(j, u);
    case 3: return RowsUnit<3>(j, u);
    case 4: return RowsUnit<4>(j, u);
    case 5: return RowsUnit<5>(j, u);
    case 6: return RowsUnit<6>(j, u);
    case 7: return RowsUnit<7>(j, u);
    default: return RowsUnit<8>(j, u);
  }
}

// y = x @ Q^T (times s): Q (O, I) int8 with s (O,) or (O, I / group), or float32 without.
template <typename W>
ffi::Error MatvecRows(ffi::Buffer<ffi::F32> x, const W* q,
                      ffi::Span<const int64_t> qd, const float* scale, ffi::Buffer<ffi::F32>& y,
                      int64_t group = 0) {
  auto xd = x.dimensions(), yd = y.dimensions();
  if (xd.size() != 2 || qd.size() != 2 || yd.size() != 2 || xd[1] != qd[1] || yd[0] != xd[0] ||
      yd[1] != qd[0])
    return ffi::Error::InvalidArgument("matvec_rows: expected x (M, I), q (O, I) and y (M, O)");
  if (xd[0] > 8) return ffi::Error::InvalidArgument("matvec_rows: at most 8 rows");
  auto job = std::make_shared<RowsJob<W>>();
  job->x = x.typed_data(), job->q = q, job->scale = scale;
  job->y = y.typed_data(), job->M = xd[0], job->I = xd[1], job->O = qd[0], job->group = group;
  if (job->M > 0) job->units = (job->O + kUnitRows - 1) / kUnitRows;
  RunUnits(job, size_t(job->O) * size_t(job->I) * sizeof(W) >= kShareBytes);
  return ffi::Error::Success();
}

ffi::Error MatvecInt8Rows(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::S8> q,
                          ffi::Buffer<ffi::F32> s, ffi::ResultBuffer<ffi::F32> y) {
  const auto qd = q.dimensions();
  const int64_t O = qd.size() == 2 ? qd[0] : -1, I = qd.size() == 2 ? qd[1] : 0;
  const int64_t G = O > 0 ? s.element_count() / O : 1;  // scales a row
  if (s.dimensions().size() != 1 || O < 0 || s.element_count() != O * G || G < 1 ||
      (G > 1 && (I % G != 0 || (I / G) % kLanes != 0)))
    return ffi::Error::InvalidArgument(
        "matvec_rows: expected x (M, I), q (O, I), s (O * G,): G scales a row, each over I / G "
        "inputs (a multiple of the vector's lanes), and y (M, O)");
  return MatvecRows(x, q.typed_data(), qd, s.typed_data(), *y, G > 1 ? I / G : 0);
}

ffi::Error MatvecF32Rows(ffi::Buffer<ffi::F32> x, ffi::Buffer<ffi::F32> w,
                         ffi::ResultBuffer<ffi::F32> y) {
  return MatvecRows(x, w.typed_data(), w.dimensions(), static_cast<const float*>(nullptr),
                    *y);
}

// -- 4-bit rows: y_k[m, o] = x[m, :] . W_k[o, :], W_k = q * d + m stored a row per output ------
//
//   y_k (M, O_k) = x (M, I) @ W_k^T    q_k (O_k, I / 2) uint8, two weights a byte along the inputs
//                                       (byte j: q[o, 2j] low, q[o, 2j + 1] high); d_k, m_k
//                                       (O_k, I / 32) float32              "jax_llama_matvec_int4"
//
// The 4-bit weights are stored as the canonical (out, in) rows, so a unit streams whole rows of
// bytes - as the rows kernel reads a tied LM head, which kept the memory busier than the (I, O)
// strips (a 4096 x 14336 int8 weight: 12-16 GB/s in strips, a 128256 x 2048 head 27 GB/s in rows,
// 2-core AMD EPYC Zen 4). Each weight is expanded in registers to q * d + m (one fused
// multiply-add: exact for a float16 d) and multiplied in:
//   AVX-512: the group's 16 possible weights are one register (q = 0..15 times d plus m), its 16
//     bytes are widened to 16 lanes, and vpermps looks up each lane's low nibble, then its high
//     one: a lane sums the group's even inputs, then its odd ones (x deinterleaved to match, once
//     a call). With more than kLookupRows rows the nibbles are converted instead, in the same
//     order and to the same fma(q, d, m): the same bits. Two lookups and two multiply-adds for 32 weights, where converting them took 18
//     operations: a 4096 x 14336 weight in 2.9 ms against 3.9 ms, SmolLM2's decode 113-122 tokens/s
//     against 92-98 (2-core AMD EPYC Zen 4, alternating runs).
//   AVX2 and plain C++: each vector of kLanes inputs split into nibbles, put back in input order,
//     widened and converted, then multiplied in as Dots multiplies a float32 row: the outputs are
//     matvec_f32_rows' on the dequantised weight, bit for bit.
// Either way an output's arithmetic depends on neither the rows beside it nor the threads.
// Several weights that read the same x (q, k and v; gate and up) are one call, their rows units
// of one job.

// 4-bit rows per unit (UnitRows4): a multiple of kUnitRows4, at least kUnitBytes4 of weights
// where a weight has enough rows, yet at least kUnitsPerThread4 units a thread, so that the
// threads share a 576-row projection evenly (512-row units left one thread 512 rows and the
// other 64). Small units cost: each is two atomic operations on a counter both threads write,
// and its last kPrefetchBytes of prefetches are for the next unit, perhaps another thread's.
// Chains of 4-bit projections, one decode step's calls in one program, 2 threads (2-core AMD EPYC
// Zen 4, alternating): 32-row units against these, LLaMA 3 8B's shapes 25.7-26.3 against
// 28.3-30.1 GB/s, Llama 3.2 1B's 21.5-24.1 against 29.3-30.9, SmolLM2's 15.9-17.0 against
// 21.7-23.5 (8-bit activations; 1B with float32 ones 12.6 against 17.2).
constexpr int64_t kUnitRows4 = 32;
constexpr int64_t kUnitBytes4 = 256 << 10;
constexpr int64_t kUnitsPerThread4 = 4;

int64_t UnitRows4(int64_t O, int64_t I, int64_t threads) {
  auto up = [](int64_t n) { return (n + kUnitRows4 - 1) / kUnitRows4 * kUnitRows4; };
  const int64_t by_bytes = up(kUnitBytes4 / std::max<int64_t>(1, I / 2));
  const int64_t by_threads = up((O + kUnitsPerThread4 * threads - 1) / (kUnitsPerThread4 * threads));
  return std::max(kUnitRows4, std::min(by_bytes, by_threads));
}

struct Rows4Part {
  const uint8_t* q;
  const float *d, *m;  // float32 scales and minima, row row0 first (Float32Scales)
  float* y;
  int64_t O, first_unit, unit_rows;  // unit_rows: UnitRows4
  const uint16_t *dh = nullptr, *mh = nullptr;  // float16 ones instead, when not nullptr
  int64_t row0 = 0;
  // no minima in memory: m = -8 d, Q4_0's w = d (q - 8) (-8 d is exact in float32, so the
  // numbers are those of the same weight with its minima held)
  bool symmetric = false;
};


void HalvesToFloats(const uint16_t* h, int64_t n, float* out) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= n; i += 16)
    _mm512_storeu_ps(out + i, _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(h + i))));
#elif defined(__F16C__)
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(out + i, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(h + i))));
#endif
  for (; i < n; ++i) out[i] = HalfToFloat(h[i]);
}

// x (M, I) with each run of `run` inputs (I a multiple of it) as its even ones, then its odd
// ones: the order a kernel widens a run's bytes in, low nibbles, then high ones (the AVX-512
// Dots4: runs of 32, a group; Dots4Bf16Factored: runs of 16, 8 bytes).
void SplitEvenOdd(const float* x, int64_t M, int64_t I, float* out, int64_t run = kGroup4) {
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < I; g += run)
      for (int64_t t = 0; t < run / 2; ++t) {
        out[m * I + g + t] = x[m * I + g + 2 * t];
        out[m * I + g + run / 2 + t] = x[m * I + g + 2 * t + 1];
      }
}

// A part whose scales and minima are float16: its rows [o, o1) with them as float32 in this
// thread's scratch (read from memory as float16, 2 bytes a group each instead of 4; converted
// once a unit, exactly); else the part itself.
inline Rows4Part Float32Scales(const Rows4Part& p, int64_t I, int64_t o, int64_t o1) {
  if (p.dh == nullptr && !p.symmetric) return p;
  thread_local std::vector<float> d, m;
  const int64_t G = I / kGroup4, n = (o1 - o) * G;
  if (d.size() < size_t(n)) d.resize(n), m.resize(n);
  if (p.dh != nullptr) HalvesToFloats(p.dh + o * G, n, d.data());
  else std::copy(p.d + o * G, p.d + o * G + n, d.data());
  if (p.symmetric)
    for (int64_t i = 0; i < n; ++i) m[i] = -8.0f * d[i];
  else
    HalvesToFloats(p.mh + o * G, n, m.data());
  Rows4Part local = p;
  local.d = d.data(), local.m = m.data(), local.row0 = o;
  return local;
}

struct Rows4Job {
  const float* x;
  int64_t M, I, units = 0;
  // "_q8" (Int4Q8): x quantised to 8 bits per group of 32 (QuantiseQ8), not read as float32
  bool q8 = false;
  const int8_t* xq = nullptr;   // (M, Q8Bytes(I)): per 4 groups, their even inputs, then odd ones
  const float* dxe = nullptr;   // (M, Q8Lanes(I)): each group's scale, once per lane of it
  const float* c = nullptr;     // (M, Q8Mins(I)): scale x the sum of the group's 8-bit values
  // "_bf16" (Int4Bf16): x rounded to bfloat16 (RoundBf16; j.x then holds the rounded values).
  // Where the CPU multiplies bfloat16 pairs (AVX512_BF16), also xb and sx; with AVX2 alone
  // (Dots4Bf16Factored), j.x in SplitBf16Halves' order and sx:
  bool bf16 = false;
  const uint16_t* xb = nullptr;  // (M, Bf16Words(I)): per 2 groups, their even inputs, then odd
  const float* sx = nullptr;     // (M, Bf16Sums(I)): each group's sum of its rounded inputs
  std::vector<Rows4Part> parts;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

#if defined(__AVX512F__)
#ifndef JAX_LLAMA_LOOKUP_ROWS
#define JAX_LLAMA_LOOKUP_ROWS 2
#endif
// Up to this many rows of x the AVX-512 Dots4 looks each weight up (vpermps); more rows share the
// expansion, and converting the nibbles is faster there (8 rows: 6.3 ms against 8.9 ms for a
// 4096 x 14336 weight). Either way a weight is fma(q, d, m), so an output's bits are the same.
constexpr int kLookupRows = JAX_LLAMA_LOOKUP_ROWS;

inline Vec Iota() {  // 0, 1, ..., 15
  return _mm512_setr_ps(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
}

#endif

#if !defined(__AVX512F__)
// kLanes weights of a row from their kLanes / 2 bytes at p, as float32 q in input order.
inline Vec Nibbles4(const uint8_t* p) {
#if defined(__AVX2__) && defined(__FMA__)
  int32_t word;
  std::memcpy(&word, p, sizeof(word));
  const __m128i b = _mm_cvtsi32_si128(word), f = _mm_set1_epi8(0x0F);
  const __m128i q = _mm_unpacklo_epi8(_mm_and_si128(b, f), _mm_and_si128(_mm_srli_epi16(b, 4), f));
  return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q));
#else
  return static_cast<float>(*p & 0x0F);  // kLanes = 1: the low nibble; Row4 takes the high
#endif
}
#endif

// y[m0 + m, o + r] for m < M, r < R (Dots' order: lanes over inputs l, l + kLanes, ..., added by
// a fixed tree), the weights expanded as they are read.
template <int M, int R, typename S = float>
void Dots4Q8(const Rows4Job& j, const Rows4Part& p, int64_t o, int64_t m0);
#if defined(__AVX512BF16__)
template <int M, int R, typename S = float>
void Dots4Bf16(const Rows4Job& j, const Rows4Part& p, int64_t o, int64_t m0);
#elif defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
template <int M, int R>
void Dots4Bf16Factored(const Rows4Job& j, const Rows4Part& p, int64_t o, int64_t m0);
#endif

template <int M, int R>
inline void Dots4(const Rows4Job& j, const Rows4Part& p, int64_t o, int64_t m0) {
  if (j.q8) return Dots4Q8<M, R>(j, p, o, m0);
#if defined(__AVX512BF16__)
  if (j.bf16) return Dots4Bf16<M, R>(j, p, o, m0);
#elif defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
  if (j.bf16) return Dots4Bf16Factored<M, R>(j, p, o, m0);
#endif
  const int64_t I = j.I, J = I / 2, G = I / kGroup4;
  const float* x = j.x + m0 * I;
  Vec acc[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = Splat(0.0f);
  const char* base = reinterpret_cast<const char*>(p.q);
  const int64_t ahead = o * J + kPrefetchBytes, last = p.O * J - 1;
  for (int64_t g = 0; g < G; ++g) {
    Vec d[R], mn[R];
    for (int r = 0; r < R; ++r) d[r] = Splat(p.d[(o + r - p.row0) * G + g]), mn[r] = Splat(p.m[(o + r - p.row0) * G + g]);
    for (int64_t b = 0; b < R * kGroup4 / 2; b += kCacheLine)
      __builtin_prefetch(base + std::min(ahead + R * g * kGroup4 / 2 + b, last));
#if defined(__AVX512F__)
    // The group's 16 possible weights q d + m (q = 0..15) in one register, and each of its 16
    // bytes widened to a lane: vpermps picks a lane's weight by the low 4 bits of its index, the
    // low nibble as it is and the high one shifted down. The lanes then hold the group's even
    // inputs and its odd ones, which x (deinterleaved by MatvecInt4Rows) matches.
    Vec even[R], odd[R];
    for (int r = 0; r < R; ++r) {
      const __m128i bytes =
          _mm_loadu_si128(reinterpret_cast<const __m128i*>(p.q + (o + r) * J + g * kGroup4 / 2));
      if constexpr (M <= kLookupRows) {  // looked up: fewer operations, few rows to share them
        const Vec table = Fma(Iota(), d[r], mn[r]);
        const __m512i b = _mm512_cvtepu8_epi32(bytes);
        even[r] = _mm512_permutexvar_ps(b, table);
        odd[r] = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), table);
      } else {  // converted: the same q d + m, so the same bits, and no vpermps to wait for
        const __m128i f = _mm_set1_epi8(0x0F);
        const __m128i lo = _mm_and_si128(bytes, f), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), f);
        even[r] = Fma(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(lo)), d[r], mn[r]);
        odd[r] = Fma(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(hi)), d[r], mn[r]);
      }
    }
    for (int m = 0; m < M; ++m) {
      const float* xg = x + m * I + g * kGroup4;
      const Vec xe = Load(xg), xo = Load(xg + kGroup4 / 2);
      for (int r = 0; r < R; ++r) acc[r][m] = Fma(xo, odd[r], Fma(xe, even[r], acc[r][m]));
    }
#elif defined(__AVX2__) && defined(__FMA__)
    for (int64_t i = g * kGroup4; i < (g + 1) * kGroup4; i += kLanes) {
      Vec wv[R];
      for (int r = 0; r < R; ++r) wv[r] = Fma(Nibbles4(p.q + (o + r) * J + i / 2), d[r], mn[r]);
      for (int m = 0; m < M; ++m) {
        const Vec xv = Load(x + m * I + i);
        for (int r = 0; r < R; ++r) acc[r][m] = Fma(xv, wv[r], acc[r][m]);
      }
    }
#else
    for (int64_t i = g * kGroup4; i < (g + 1) * kGroup4; ++i)
      for (int r = 0; r < R; ++r) {
        const uint8_t byte = p.q[(o + r) * J + i / 2];
        const float w = std::fma(static_cast<float>(i % 2 ? byte >> 4 : byte & 0x0F), d[r], mn[r]);
        for (int m = 0; m < M; ++m) acc[r][m] = std::fma(x[m * I + i], w, acc[r][m]);
      }
#endif
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) p.y[(m0 + m) * p.O + o + r] = HorizontalSum(acc[r][m]);
}

// -- 4-bit rows with bfloat16 activations: "jax_llama_matvec_int4_bf16" ------------------------
//
// x is rounded to bfloat16 (to nearest, ties to even; RoundBf16: the same bits on every CPU), then
// multiplied as float32 x is: y = x' @ W^T within float32 rounding, x' the rounded x. bfloat16
// keeps 8 significant bits of each input, where 8-bit activations keep 8 bits of a group's
// largest: SmolLM2's Q4_1 file answers "What is the capital of France?" with Paris this way, and
// with nonsense with 8-bit activations (and in llama.cpp). Where the CPU has AVX512_BF16,
// Dots4Bf16 multiplies bfloat16 pairs (vdpbf16ps); with AVX2 alone, Dots4Bf16Factored multiplies
// x' by q (exact) and scales each group's sum once; elsewhere (AVX-512 without BF16, the plain
// build) the float32 kernel runs on x'.

// float32 -> the nearest bfloat16, as float32 (ties to even; a NaN stays a NaN)
inline float RoundBf16(float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof(u));
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) u |= 0x00400000u;
  else u += 0x7FFFu + ((u >> 16) & 1u);
  u &= 0xFFFF0000u;
  std::memcpy(&v, &u, sizeof(v));
  return v;
}

// RoundBf16 of n floats at x, into out (AVX-512: 16 at a time, the same integer steps)
void RoundBf16s(const float* x, int64_t n, float* out) {
  int64_t i = 0;
#if defined(__AVX512F__)
  const __m512i magnitude = _mm512_set1_epi32(0x7FFFFFFF), infinity = _mm512_set1_epi32(0x7F800000);
  const __m512i half = _mm512_set1_epi32(0x7FFF), one = _mm512_set1_epi32(1);
  const __m512i quiet = _mm512_set1_epi32(0x00400000), top = _mm512_set1_epi32(int(0xFFFF0000u));
  for (; i + 16 <= n; i += 16) {
    const __m512i u = _mm512_loadu_si512(x + i);
    const __mmask16 nan =
        _mm512_cmpgt_epu32_mask(_mm512_and_si512(u, magnitude), infinity);
    __m512i r = _mm512_add_epi32(
        u, _mm512_add_epi32(half, _mm512_and_si512(_mm512_srli_epi32(u, 16), one)));
    r = _mm512_mask_or_epi32(r, nan, u, quiet);
    _mm512_storeu_si512(out + i, _mm512_and_si512(r, top));
  }
#endif
  for (; i < n; ++i) out[i] = RoundBf16(x[i]);
}

// x' as the AVX512_BF16 kernel reads it: per block of 4 groups (128 inputs), 4 vectors of 32
// bfloat16 words, word k of vector t being 16 x'[4 k + t] (the padding zero); and each group's
// sum of x', padded with zeros to a whole vector of groups
constexpr int64_t Bf16Words(int64_t I) { return (I / kGroup4 + 3) / 4 * 128; }
constexpr int64_t Bf16Sums(int64_t I) { return (I / kGroup4 + 15) / 16 * 16; }

// -- 4-bit rows with 8-bit activations: "jax_llama_matvec_int4_q8" -----------------------------
//
// What llama.cpp does for its Q4 types: x is quantised per group of 32 inputs to 8 bits, and
// each group's products are summed as integers. For row m and group g of x:
//   dx = max |x| * float32(1 / 127), xq = x * (1 / dx) rounded to the nearest integer (ties to
//   even; 0 where dx is 0), s = the sum of the group's xq, c = dx * s (float32);
//   y[m, o] = sum_g (dw[o, g] * dx) * isum_g + sum_g mw[o, g] * c_g,
// isum_g = sum_i q[o, i] xq_i exactly (an integer below 2^16). That is x' @ W^T exactly, x' the
// dequantised dx * xq, up to float32 rounding of the sums; against x @ W^T it adds x's
// quantisation error (at most dx / 2 an input). Sums: AVX-512, 16 lanes, 4 groups at a time (4
// lanes a group: vpdpbusd, or vpmaddubsw + vpmaddwd without VNNI; the last 1-3 groups by masked
// loads), each lane's integer times its group's dw * dx, then added by a fixed tree; AVX2, the
// same over 2 groups (8 lanes), an odd last group alone; plain C++, group by group in order; then
// the minima's sum (lanes over groups, a fixed tree, the rest in order). Nothing depends on M,
// the rows beside a row or the threads. A 4096 x 14336 weight: 1.3-1.4 ms against 2.4-2.6 ms with
// float32 x (2-core AMD EPYC Zen 4, alternating calls); SmolLM2's small projections about even.

constexpr int64_t Q8Blocks(int64_t I) { return (I / kGroup4 + 3) / 4; }   // of 4 groups
constexpr int64_t Q8Bytes(int64_t I) { return Q8Blocks(I) * 128; }
constexpr int64_t Q8Lanes(int64_t I) { return Q8Blocks(I) * 16; }  // 4 a group
constexpr int64_t Q8Mins(int64_t I) { return (I / kGroup4 + 15) / 16 * 16; }

// 1 / 127 in float32: dx = max |x| * kInv127 (a multiplication: XLA turns a division by a
// constant into one, so every implementation multiplies by the same float32 constant)
constexpr float kInv127 = 1.0f / 127.0f;

// x (M, I) -> xq, dxe, c (layouts in Rows4Job); the padding is zero.
void QuantiseQ8(const float* x, int64_t M, int64_t I, int8_t* xq, float* dxe, float* c) {
  const int64_t G = I / kGroup4, bytes = Q8Bytes(I), lanes = Q8Lanes(I), mins = Q8Mins(I);
  std::fill(xq, xq + M * bytes, int8_t{0});
  std::fill(dxe, dxe + M * lanes, 0.0f);
  std::fill(c, c + M * mins, 0.0f);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) {
      const float* xg = x + m * I + g * kGroup4;
      float amax = 0.0f;
      for (int64_t i = 0; i < kGroup4; ++i) amax = std::max(amax, std::fabs(xg[i]));
      const float d = amax * kInv127, inv = d > 0.0f ? 1.0f / d : 0.0f;
      int8_t* block = xq + m * bytes + (g / 4) * 128 + (g % 4) * 16;
      int32_t sum = 0;
      for (int64_t t = 0; t < kGroup4 / 2; ++t)
        for (int odd = 0; odd < 2; ++odd) {
          const float r = std::nearbyint(xg[2 * t + odd] * inv);  // ties to even
          const int8_t v = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, r)));
          block[odd * 64 + t] = v;
          sum += v;
        }
      for (int k = 0; k < 4; ++k) dxe[m * lanes + g * 4 + k] = d;
      c[m * mins + g] = d * static_cast<float>(sum);
    }
}

// One group's integer sum, in order (the groups no vector covers, and the plain build).
inline int32_t GroupSumQ8(const uint8_t* q, const int8_t* xq_row, int64_t g) {
  const int8_t* block = xq_row + (g / 4) * 128 + (g % 4) * 16;
  int32_t s = 0;
  for (int t = 0; t < kGroup4 / 2; ++t)
    s += (q[g * 16 + t] & 0x0F) * block[t] + (q[g * 16 + t] >> 4) * block[64 + t];
  return s;
}

#ifndef JAX_LLAMA_Q8_ROWS
#define JAX_LLAMA_Q8_ROWS 1
#endif
constexpr int kQ8Rows = JAX_LLAMA_Q8_ROWS;

// A scale or minimum of either dtype, as float32: one, kLanes in a row (Load's), or the first n
// <= 4 of 4 in a row (the rest 0).
inline float ScalarOf(const float* p) { return *p; }
inline float ScalarOf(const uint16_t* p) { return HalfToFloat(*p); }
inline Vec LoadScales(const float* p) { return Load(p); }
inline Vec LoadScales(const uint16_t* p) {
#if defined(__AVX512F__)
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
#elif defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
#elif defined(__AVX2__) && defined(__FMA__)
  alignas(32) float f[8];
  for (int k = 0; k < 8; ++k) f[k] = HalfToFloat(p[k]);
  return _mm256_load_ps(f);
#else
  return HalfToFloat(*p);
#endif
}
#if defined(__x86_64__) && (defined(__AVX2__) || defined(__AVX512F__))
inline __m128 Load4Scales(const float* p, int n) {
  if (n == 4) return _mm_loadu_ps(p);
#if defined(__AVX512VL__)
  return _mm_maskz_loadu_ps(static_cast<__mmask8>((1u << n) - 1), p);
#else
  alignas(16) float f[4] = {0.0f, 0.0f, 0.0f, 0.0f};
  for (int k = 0; k < n; ++k) f[k] = p[k];
  return _mm_load_ps(f);
#endif
}
inline __m128 Load4Scales(const uint16_t* p, int n) {
  __m128i h;
  if (n == 4) {
    h = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  } else {
#if defined(__AVX512VL__) && defined(__AVX512BW__)
    h = _mm_maskz_loadu_epi16(static_cast<__mmask8>((1u << n) - 1), p);
#else
    alignas(16) uint16_t b[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    for (int k = 0; k < n; ++k) b[k] = p[k];
    h = _mm_load_si128(reinterpret_cast<const __m128i*>(b));
#endif
  }
#if defined(__F16C__) || defined(__AVX512F__)
  return _mm_cvtph_ps(h);
#else
  alignas(16) uint16_t b[8];
  _mm_store_si128(reinterpret_cast<__m128i*>(b), h);
  return _mm_setr_ps(HalfToFloat(b[0]), HalfToFloat(b[1]), HalfToFloat(b[2]), HalfToFloat(b[3]));
#endif
}
#endif

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
inline __m128 Load2Scales(const float* p) {
  return _mm_castpd_ps(_mm_load_sd(reinterpret_cast<const double*>(p)));
}
inline __m128 Load2Scales(const uint16_t* p) {
  int32_t word;
  std::memcpy(&word, p, sizeof(word));
#if defined(__F16C__)
  return _mm_cvtph_ps(_mm_cvtsi32_si128(word));
#else
  return _mm_setr_ps(HalfToFloat(p[0]), HalfToFloat(p[1]), 0.0f, 0.0f);
#endif
}
#endif

// S: the scales' and minima's dtype as they lie in memory (float, or uint16_t for float16: read
// at 2 bytes each and converted in registers, exactly).
// A part's scales and minima as Dots4Q8 and Dots4Bf16 read them in place (S: float, or float16's
// bits), and the minima's factor: -8 where a symmetric part holds none (m = -8 d, read from the
// scales again), else 1.
template <typename S>
struct ScalesOf {
  const S* d;
  const S* m;
  float factor;
  explicit ScalesOf(const Rows4Part& p) {
    if constexpr (std::is_same_v<S, float>) d = p.d, m = p.m;
    else d = p.dh, m = p.mh;
    factor = p.symmetric ? -8.0f : 1.0f;
    if (p.symmetric) m = d;
  }
};

template <int M, int R, typename S>
void Dots4Q8(const Rows4Job& j, const Rows4Part& p, int64_t o, int64_t m0) {
  const ScalesOf<S> scales(p);
  const S *D = scales.d, *Mn = scales.m;
  const float mf = scales.factor;
  const int64_t I = j.I, J = I / 2, G = I / kGroup4, bytes = Q8Bytes(I);
  const int64_t lanes = Q8Lanes(I), mins = Q8Mins(I);
  Vec acc[R][M], low[R][M];
  float tail[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = Splat(0.0f), low[r][m] = Splat(0.0f), tail[r][m] = 0.0f;
  const char* base = reinterpret_cast<const char*>(p.q);
  const int64_t ahead = o * J + kPrefetchBytes, last = p.O * J - 1;
  int64_t g = 0;
#if defined(__AVX512F__) && defined(__AVX512BW__)
  const __m512i f = _mm512_set1_epi8(0x0F);
  const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
#if !defined(__AVX512VNNI__)
  const __m512i ones = _mm512_set1_epi16(1);
#endif
  // 4 groups at a time; the last 1-3 by masked loads (x's padding is zero)
  for (; g < G; g += 4) {
    const int n = static_cast<int>(std::min<int64_t>(4, G - g));
    const __mmask64 bytes_in = n == 4 ? ~__mmask64{0} : (__mmask64{1} << (16 * n)) - 1;
    for (int r = 0; r < R; ++r)
      __builtin_prefetch(base + std::min(ahead + R * g * kGroup4 / 2 + r * 64, last));
    for (int r = 0; r < R; ++r) {  // a row at a time: its bytes, then every row of x
      const __m512i b = _mm512_maskz_loadu_epi8(bytes_in, p.q + (o + r) * J + g * 16);
      const __m512i lo = _mm512_and_si512(b, f), hi = _mm512_and_si512(_mm512_srli_epi16(b, 4), f);
      const __m128 d4 = Load4Scales(D + (o + r - p.row0) * G + g, n);
      const Vec dw = _mm512_permutexvar_ps(spread, _mm512_castps128_ps512(d4));
      for (int m = 0; m < M; ++m) {
        const int8_t* xb = j.xq + (m0 + m) * bytes + (g / 4) * 128;
        const __m512i xe = _mm512_loadu_si512(xb), xo = _mm512_loadu_si512(xb + 64);
#if defined(__AVX512VNNI__)
        const __m512i s =
            _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, xe), hi, xo);
#else
        const __m512i s = _mm512_add_epi32(_mm512_madd_epi16(_mm512_maddubs_epi16(lo, xe), ones),
                                           _mm512_madd_epi16(_mm512_maddubs_epi16(hi, xo), ones));
#endif
        const Vec dx = Load(j.dxe + (m0 + m) * lanes + g * 4);
        acc[r][m] = Fma(_mm512_cvtepi32_ps(s), Mul(dw, dx), acc[r][m]);
      }
    }
  }
#elif defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
  const __m256i f = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const __m256i spread = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
  for (; g + 2 <= G; g += 2) {
    for (int r = 0; r < R; ++r)
      __builtin_prefetch(base + std::min(ahead + R * g * kGroup4 / 2 + r * 64, last));
    for (int r = 0; r < R; ++r) {
      const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p.q + (o + r) * J + g * 16));
      const __m256i lo = _mm256_and_si256(b, f), hi = _mm256_and_si256(_mm256_srli_epi16(b, 4), f);
      const __m128 two = Load2Scales(D + (o + r - p.row0) * G + g);
      const Vec dw = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(two), spread);
      for (int m = 0; m < M; ++m) {
        const int8_t* xb = j.xq + (m0 + m) * bytes + (g / 4) * 128 + (g % 4) * 16;
        const __m256i xe = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb));
        const __m256i xo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xb + 64));
        const __m256i s = _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(lo, xe), ones),
                                           _mm256_madd_epi16(_mm256_maddubs_epi16(hi, xo), ones));
        const Vec dx = Load(j.dxe + (m0 + m) * lanes + g * 4);
        acc[r][m] = Fma(_mm256_cvtepi32_ps(s), Mul(dw, dx), acc[r][m]);
      }
    }
  }
#endif
  for (; g < G; ++g)  // the groups past the last full vector, in order
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m) {
        const int32_t s = GroupSumQ8(p.q + (o + r) * J, j.xq + (m0 + m) * bytes, g);
        const float scale = ScalarOf(D + (o + r - p.row0) * G + g) * j.dxe[(m0 + m) * lanes + g * 4];
        tail[r][m] = std::fma(static_cast<float>(s), scale, tail[r][m]);
      }
  // the minima: sum_g mw[o, g] * c_g, lanes over groups
  int64_t h = 0;
  for (; h + kLanes <= G; h += kLanes)
    for (int r = 0; r < R; ++r) {
      const Vec mw = Mul(LoadScales(Mn + (o + r - p.row0) * G + h), Splat(mf));
      for (int m = 0; m < M; ++m) low[r][m] = Fma(mw, Load(j.c + (m0 + m) * mins + h), low[r][m]);
    }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) {
      float rest = 0.0f;
      for (int64_t k = h; k < G; ++k)
        rest = std::fma(ScalarOf(Mn + (o + r - p.row0) * G + k) * mf, j.c[(m0 + m) * mins + k],
                        rest);
      p.y[(m0 + m) * p.O + o + r] =
          (HorizontalSum(acc[r][m]) + tail[r][m]) + (HorizontalSum(low[r][m]) + rest);
    }
}

// Rows [o, o1) with 8-bit x, the scales read in place as they lie (S: float or float16's bits).
template <int M, typename S>
void Q8Rows(const Rows4Job& j, const Rows4Part& p, int64_t o, int64_t o1) {
  for (; o + kQ8Rows <= o1; o += kQ8Rows) Dots4Q8<M, kQ8Rows, S>(j, p, o, 0);
  for (; o < o1; ++o) Dots4Q8<M, 1, S>(j, p, o, 0);
}

#if defined(__AVX512BF16__)
// n <= 16 scales (float32, or float16's bits) as float32 lanes, the rest zero
inline Vec LoadScalesN(const float* p, int n) {
  return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), p);
}
inline Vec LoadScalesN(const uint16_t* p, int n) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(static_cast<__mmask16>((1u << n) - 1), p));
}

// The word indices SplitBf16 gathers by (_mm512_permutex2var_epi16), made once: `tops` takes
// the top half of each float of two vectors, in order; low[t] and high[t] take word k of vector
// t, input 4 k + t, from the first pair of gathered vectors (k < 16: word 4 k + t of their 64)
// and from the second (k >= 16: word 4 (k - 16) + t).
struct Bf16Gathers {
  __m512i tops, low[4], high[4];
  Bf16Gathers() {
    alignas(64) uint16_t a[32], lo[4][32], hi[4][32];
    for (int k = 0; k < 32; ++k) {
      a[k] = uint16_t(2 * k + 1);
      for (int t = 0; t < 4; ++t) {
        lo[t][k] = uint16_t(k < 16 ? 4 * k + t : 0);
        hi[t][k] = uint16_t(k >= 16 ? 4 * (k - 16) + t : 0);
      }
    }
    tops = _mm512_load_si512(a);
    for (int t = 0; t < 4; ++t) low[t] = _mm512_load_si512(lo[t]), high[t] = _mm512_load_si512(hi[t]);
  }
};

// x' (M, I) -> xb and sx (Bf16Words, Bf16Sums), a block of 4 groups (128 inputs) at a time: its
// 8 vectors of 16 x' times 16 (exact: x' is a bfloat16, 16 a power of 2), whose top halves are
// the bfloat16 words; gathered in input order (32 a vector), then every fourth into vector t.
// A group's sum of x' is its two vectors added, then a fixed tree (HorizontalSum).
void SplitBf16(const float* x, int64_t M, int64_t I, uint16_t* xb, float* sx) {
  static const Bf16Gathers gather;
  const int64_t G = I / kGroup4, words = Bf16Words(I), sums = Bf16Sums(I);
  std::fill(sx, sx + M * sums, 0.0f);
  const Vec sixteen = Splat(16.0f);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; g += 4) {
      const int n = static_cast<int>(std::min<int64_t>(4, G - g));  // the rest: zero
      __m512i ordered[4];  // the block's words in input order, 32 a vector (a group's)
      for (int k = 0; k < 4; ++k) {
        Vec a = Splat(0.0f), b = Splat(0.0f);
        if (k < n) {
          const float* xg = x + m * I + (g + k) * kGroup4;
          a = Load(xg), b = Load(xg + kLanes);
          sx[m * sums + g + k] = HorizontalSum(Add(a, b));
        }
        ordered[k] = _mm512_permutex2var_epi16(_mm512_castps_si512(Mul(a, sixteen)), gather.tops,
                                               _mm512_castps_si512(Mul(b, sixteen)));
      }
      uint16_t* out = xb + m * words + g / 4 * 128;
      for (int t = 0; t < 4; ++t) {
        const __m512i low = _mm512_permutex2var_epi16(ordered[0], gather.low[t], ordered[1]);
        const __m512i high = _mm512_permutex2var_epi16(ordered[2], gather.high[t], ordered[3]);
        _mm512_storeu_si512(out + t * 32, _mm512_mask_blend_epi16(0xFFFF0000u, low, high));
      }
    }
}

// Dots4's outputs with x' in bfloat16. A row's 64 bytes (4 groups) are 128 weights; a 16-bit
// word of them holds 4 nibbles, weights 4k .. 4k + 3, and each is put in place as the bfloat16
// 1 + q / 16 (bits 0x3F80 | q << 3: exact), so no widening is needed: vector t holds weight
// 4k + t in word k, as x's vector t holds 16 x'[4k + t]. vdpbf16ps sums each lane's two products
// (exact in float32); lane l belongs to group l / 4, so one vector of 4 scales spread over the
// lanes scales the sum: sum_i (16 x'_i)(1 + q_i / 16) = 16 sum x' + sum q x', and
//   y = sum_g d_g (that) + sum_g (m_g - 16 d_g) (sum_g x').
// 16 weights' products a vdpbf16ps against 8 a multiply-add with float32 x, and the nibbles
// need shifts and masks only, where float32 x needs them widened to 32 bits and looked up:
// SmolLM2's decode 160 against 131 tokens/s, LLaMA 3 8B's 1.23x (2-core AMD EPYC Zen 4,
// alternating runs). Splitting the four vdpbf16ps into two chains of two: 8B shapes 1.13x,
// SmolLM2's 0.91x, both within this machine's spread; left as one chain.
template <int M, int R, typename S>
void Dots4Bf16(const Rows4Job& j, const Rows4Part& p, int64_t o, int64_t m0) {
  const ScalesOf<S> scales(p);
  const S *D = scales.d, *Mn = scales.m;
  const float mf = scales.factor;
  const int64_t I = j.I, J = I / 2, G = I / kGroup4, words = Bf16Words(I), sums = Bf16Sums(I);
  Vec acc[R][M], low[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = Splat(0.0f), low[r][m] = Splat(0.0f);
  const char* base = reinterpret_cast<const char*>(p.q);
  const int64_t ahead = o * J + kPrefetchBytes, last = p.O * J - 1;
  const __m512i nibble = _mm512_set1_epi16(0x0078), one = _mm512_set1_epi16(0x3F80);
  const __m512i spread = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
  for (int64_t g = 0; g < G; g += 4) {  // the last 1-3 groups by masked loads (padding: zero)
    const int n = static_cast<int>(std::min<int64_t>(4, G - g));
    const __mmask64 bytes_in = n == 4 ? ~__mmask64{0} : (__mmask64{1} << (16 * n)) - 1;
    for (int r = 0; r < R; ++r)
      __builtin_prefetch(base + std::min(ahead + R * g * kGroup4 / 2 + r * 64, last));
    for (int r = 0; r < R; ++r) {
      const __m512i b = _mm512_maskz_loadu_epi8(bytes_in, p.q + (o + r) * J + g * 16);
      // (shifted & 0x78) | 0x3F80: the nibble at bits 3-6 of a bfloat16 1.0
      const __m512i w0 = _mm512_ternarylogic_epi32(_mm512_slli_epi16(b, 3), nibble, one, 0xEA);
      const __m512i w1 = _mm512_ternarylogic_epi32(_mm512_srli_epi16(b, 1), nibble, one, 0xEA);
      const __m512i w2 = _mm512_ternarylogic_epi32(_mm512_srli_epi16(b, 5), nibble, one, 0xEA);
      const __m512i w3 = _mm512_ternarylogic_epi32(_mm512_srli_epi16(b, 9), nibble, one, 0xEA);
      const Vec dw = _mm512_permutexvar_ps(
          spread, _mm512_castps128_ps512(Load4Scales(D + (o + r - p.row0) * G + g, n)));
      for (int m = 0; m < M; ++m) {
        const uint16_t* xw = j.xb + (m0 + m) * words + g / 4 * 128;
        Vec t = _mm512_dpbf16_ps(Splat(0.0f), (__m512bh)w0, (__m512bh)_mm512_loadu_si512(xw));
        t = _mm512_dpbf16_ps(t, (__m512bh)w1, (__m512bh)_mm512_loadu_si512(xw + 32));
        t = _mm512_dpbf16_ps(t, (__m512bh)w2, (__m512bh)_mm512_loadu_si512(xw + 64));
        t = _mm512_dpbf16_ps(t, (__m512bh)w3, (__m512bh)_mm512_loadu_si512(xw + 96));
        acc[r][m] = Fma(t, dw, acc[r][m]);
      }
    }
  }
  // sum_g (m_g - 16 d_g) sum(x'_g), lanes over groups (the padding's sums are zero)
  for (int64_t h = 0; h < G; h += kLanes) {
    const int n = static_cast<int>(std::min<int64_t>(kLanes, G - h));
    for (int r = 0; r < R; ++r) {
      const int64_t at = (o + r - p.row0) * G + h;
      const Vec d = LoadScalesN(D + at, n), mn = Mul(LoadScalesN(Mn + at, n), Splat(mf));
      const Vec coefficient = Fma(d, Splat(-16.0f), mn);
      for (int m = 0; m < M; ++m)
        low[r][m] = Fma(coefficient, Load(j.sx + (m0 + m) * sums + h), low[r][m]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m)
      p.y[(m0 + m) * p.O + o + r] = HorizontalSum(acc[r][m]) + HorizontalSum(low[r][m]);
}

// Rows [o, o1) with bfloat16 x', the scales read in place as they lie (S: float or float16's bits).
template <int M, typename S>
void Bf16Rows(const Rows4Job& j, const Rows4Part& p, int64_t o, int64_t o1) {
  constexpr int R = M == 1 ? 2 : M == 2 ? 2 : 1;
  for (; o + R <= o1; o += R) Dots4Bf16<M, R, S>(j, p, o, 0);
  for (; o < o1; ++o) Dots4Bf16<M, 1, S>(j, p, o, 0);
}
#endif

#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
#ifndef JAX_LLAMA_BF16_ROWS
#define JAX_LLAMA_BF16_ROWS 4
#endif
// Dots4's outputs with x' in bfloat16 on AVX2 (no bfloat16 products): the weight factored out of
// each group, y = sum_g d_g (sum_i x'_i q_i) + sum_g m_g (sum x'_g). A product x' q is exact in
// float32 (8 significant bits times 4), so a group's sum is the float32 sum of exact terms; the
// weights are never formed as q d + m. A group's 16 bytes are two runs of 8, each widened to 8
// lanes whose low nibble is an even input and high one the next odd input (x' split to match:
// SplitBf16Halves); per 32 weights, 2 widening loads, 2 masks, 2 shifts, 4 conversions and 4
// multiply-adds, and one more to scale the group, where forming the weights took 8 operations
// per 8 (the same kernel on float32 x). Lanes over a group's inputs, each lane's group sum scaled
// into its accumulator group by group, then a fixed tree; the minima's sum as Dots4Bf16's. Nothing
// depends on M, the rows beside a row or the threads. On the AVX2 path of a 2-core Intel Xeon
// (Sapphire Rapids, built for x86-64-v3), against the float32 kernel on x': SmolLM2's projections
// 1.73x, LLaMA 3 8B's 1.46x (scripts/int4_stream.py, results/kernels/bf16_avx2); an AVX2-only
// CPU not measured.
template <int M, int R>
void Dots4Bf16Factored(const Rows4Job& j, const Rows4Part& p, int64_t o, int64_t m0) {
  const int64_t I = j.I, J = I / 2, G = I / kGroup4, sums = Bf16Sums(I);
  const float* x = j.x + m0 * I;
  Vec acc[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = Splat(0.0f);
  const char* base = reinterpret_cast<const char*>(p.q);
  const int64_t ahead = o * J + kPrefetchBytes, last = p.O * J - 1;
  const __m256i f = _mm256_set1_epi32(0x0F);
  for (int64_t g = 0; g < G; ++g) {
    for (int64_t b = 0; b < R * kGroup4 / 2; b += kCacheLine)
      __builtin_prefetch(base + std::min(ahead + R * g * kGroup4 / 2 + b, last));
    Vec t[R][M];
    for (int h = 0; h < 2; ++h) {  // the group's bytes 8 h .. 8 h + 7: inputs 16 h .. 16 h + 15
      Vec even[R], odd[R];
      for (int r = 0; r < R; ++r) {
        const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64(
            reinterpret_cast<const __m128i*>(p.q + (o + r) * J + g * kGroup4 / 2 + 8 * h)));
        even[r] = _mm256_cvtepi32_ps(_mm256_and_si256(b, f));
        odd[r] = _mm256_cvtepi32_ps(_mm256_srli_epi32(b, 4));
      }
      for (int m = 0; m < M; ++m) {
        const float* xg = x + m * I + g * kGroup4 + 16 * h;
        const Vec xe = Load(xg), xo = Load(xg + kLanes);
        for (int r = 0; r < R; ++r)
          t[r][m] = Fma(xo, odd[r], h == 0 ? Mul(xe, even[r]) : Fma(xe, even[r], t[r][m]));
      }
    }
    for (int r = 0; r < R; ++r) {
      const Vec d = Splat(p.d[(o + r - p.row0) * G + g]);
      for (int m = 0; m < M; ++m) acc[r][m] = Fma(t[r][m], d, acc[r][m]);
    }
  }
  // sum_g m_g sum(x'_g): lanes over groups, then the rest in order
  Vec low[R][M];
  float rest[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) low[r][m] = Splat(0.0f), rest[r][m] = 0.0f;
  int64_t h = 0;
  for (; h + kLanes <= G; h += kLanes)
    for (int r = 0; r < R; ++r) {
      const Vec mn = Load(p.m + (o + r - p.row0) * G + h);
      for (int m = 0; m < M; ++m) low[r][m] = Fma(mn, Load(j.sx + (m0 + m) * sums + h), low[r][m]);
    }
  for (; h < G; ++h)
    for (int r = 0; r < R; ++r)
      for (int m = 0; m < M; ++m)
        rest[r][m] = std::fma(p.m[(o + r - p.row0) * G + h], j.sx[(m0 + m) * sums + h], rest[r][m]);
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m)
      p.y[(m0 + m) * p.O + o + r] = HorizontalSum(acc[r][m]) + (HorizontalSum(low[r][m]) + rest[r][m]);
}

// x' (M, I) as Dots4Bf16Factored reads it: each run of 16 inputs as its 8 even ones, then its 8
// odd ones; and each group's sum of x' (a fixed tree over its 4 vectors), padded with zeros to
// Bf16Sums.
void SplitBf16Halves(const float* x, int64_t M, int64_t I, float* out, float* sx) {
  const int64_t G = I / kGroup4, sums = Bf16Sums(I);
  SplitEvenOdd(x, M, I, out, 16);
  std::fill(sx, sx + M * sums, 0.0f);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) {
      const float* xg = x + m * I + g * kGroup4;
      sx[m * sums + g] = HorizontalSum(Add(Add(Load(xg), Load(xg + 8)),
                                           Add(Load(xg + 16), Load(xg + 24))));
    }
}
#endif

template <int M>
void Rows4Unit(const Rows4Job& j, const Rows4Part& part, int64_t u) {
  constexpr int R = RowsAtOnce(M);
  int64_t o = u * part.unit_rows, o1 = std::min(part.O, o + part.unit_rows);
  if (j.q8)
    return part.dh != nullptr ? Q8Rows<M, uint16_t>(j, part, o, o1) : Q8Rows<M, float>(j, part, o, o1);
#if defined(__AVX512BF16__)
  if (j.bf16)
    return part.dh != nullptr ? Bf16Rows<M, uint16_t>(j, part, o, o1)
                              : Bf16Rows<M, float>(j, part, o, o1);
#endif
  // float32 x: a unit's float16 scales converted first (the expansion reads each group's scale
  // and minimum as a scalar, faster from this thread's scratch than from memory)
  const Rows4Part p = Float32Scales(part, j.I, o, o1);
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
  if (j.bf16) {  // 2 R M accumulators of 16 registers
    constexpr int RB = M == 1 ? JAX_LLAMA_BF16_ROWS : M == 2 ? 2 : 1;
    for (; o + RB <= o1; o += RB) Dots4Bf16Factored<M, RB>(j, p, o, 0);
    for (; o < o1; ++o) Dots4Bf16Factored<M, 1>(j, p, o, 0);
    return;
  }
#endif
  for (; o + R <= o1; o += R) Dots4<M, R>(j, p, o, 0);
  for (; o < o1; ++o) Dots4<M, 1>(j, p, o, 0);
}

// More than 8 rows (a short prefill): each group of R weight rows, expanded for a chunk of 8
// rows of x at a time, stays in cache across the chunks. An output's arithmetic is the same
// whatever its chunk and R, so its bits are those of a call with its row alone.
template <int R>
void Dots4Chunks(const Rows4Job& j, const Rows4Part& p, int64_t o) {
  for (int64_t m0 = 0; m0 < j.M; m0 += 8) {
    switch (std::min<int64_t>(8, j.M - m0)) {
      case 1: Dots4<1, R>(j, p, o, m0); break;
      case 2: Dots4<2, R>(j, p, o, m0); break;
      case 3: Dots4<3, R>(j, p, o, m0); break;
      case 4: Dots4<4, R>(j, p, o, m0); break;
      case 5: Dots4<5, R>(j, p, o, m0); break;
      case 6: Dots4<6, R>(j, p, o, m0); break;
      case 7: Dots4<7, R>(j, p, o, m0); break;
      default: Dots4<8, R>(j, p, o, m0); break;
    }
  }
}

void Rows4UnitChunks(const Rows4Job& j, const Rows4Part& part, int64_t u) {
  constexpr int R = RowsAtOnce(8);
  int64_t o = u * part.unit_rows, o1 = std::min(part.O, o + part.unit_rows);
  const Rows4Part p = Float32Scales(part, j.I, o, o1);
  for (; o + R <= o1; o += R) Dots4Chunks<R>(j, p, o);
  for (; o < o1; ++o) Dots4Chunks<1>(j, p, o);
}

void RunUnit(const Rows4Job& j, int64_t u) {
  size_t k = 0;
  while (k + 1 < j.parts.size() && u >= j.parts[k + 1].first_unit) ++k;
  const Rows4Part& p = j.parts[k];
  u -= p.first_unit;
  switch (j.M) {
    case 1: return Rows4Unit<1>(j, p, u);
    case 2: return Rows4Unit<2>(j, p, u);
    case 3: return Rows4Unit<3>(j, p, u);
    case 4: return Rows4Unit<4>(j, p, u);
    case 5: return Rows4Unit<5>(j, p, u);
    case 6: return Rows4Unit<6>(j, p, u);
    case 7: return Rows4Unit<7>(j, p, u);
    case 8: return Rows4Unit<8>(j, p, u);
    default: return Rows4UnitChunks(j, p, u);
  }
}

// x, then (q_k, d_k, m_k) for each weight k; one output y_k (M, O_k) each. q8: x quantised to
// 8 bits per group ("jax_llama_matvec_int4_q8").
enum class Activations { kFloat32, kInt8, kBfloat16 };

// Weight k of a 4-bit call - q (O, I / 2) uint8, scale (O, I / 32) and min (O, I / 32) or (0,):
// none, m = -8 scale; both float32 or both float16 - and its output y (M, O), into a part's
// q, d / dh, m / mh, symmetric, y and O (Rows4Part, PromptPart); false where they are not so.
template <typename Part>
bool ReadInt4(ffi::RemainingArgs& args, ffi::RemainingRets& rets, size_t k, int64_t M, int64_t I,
              Part& part) {
  auto q = args.get<ffi::Buffer<ffi::U8>>(3 * k);
  auto d = args.get<ffi::AnyBuffer>(3 * k + 1);
  auto m = args.get<ffi::AnyBuffer>(3 * k + 2);
  auto y = rets.get<ffi::Buffer<ffi::F32>>(k);
  if (!q.has_value() || !d.has_value() || !m.has_value() || !y.has_value()) return false;
  const ffi::DataType kind = d->element_type();
  if ((kind != ffi::DataType::F32 && kind != ffi::DataType::F16) || m->element_type() != kind)
    return false;
  auto qd = q->dimensions(), yd = (*y)->dimensions();
  const int64_t O = qd.size() == 2 ? qd[0] : -1, G = I / kGroup4;
  const bool symmetric = m->element_count() == 0;
  if (O < 0 || qd[1] * 2 != I || d->element_count() != O * G ||
      (!symmetric && m->element_count() != O * G) || yd.size() != 2 || yd[0] != M || yd[1] != O)
    return false;
  part.q = q->typed_data(), part.y = (*y)->typed_data(), part.O = O, part.symmetric = symmetric;
  if (kind == ffi::DataType::F32) {
    part.d = static_cast<const float*>(d->untyped_data());
    if (!symmetric) part.m = static_cast<const float*>(m->untyped_data());
  } else {
    part.dh = static_cast<const uint16_t*>(d->untyped_data());
    if (!symmetric) part.mh = static_cast<const uint16_t*>(m->untyped_data());
  }
  return true;
}

ffi::Error Int4Rows(ffi::Buffer<ffi::F32> x, ffi::RemainingArgs args, ffi::RemainingRets rets,
                    Activations activations) {
  const bool q8 = activations == Activations::kInt8;
  constexpr const char* kWhat =
      "matvec_int4: expected x (M, I), then (q (O, I / 2) uint8, scale (O, I / 32) and min "
      "(O, I / 32) or (0,): none, m = -8 scale; both float32 or both float16) per output y "
      "(M, O); I a multiple of 32";
  auto xd = x.dimensions();
  if (xd.size() != 2 || xd[1] % kGroup4 || rets.size() == 0 ||
      args.size() != 3 * rets.size())
    return ffi::Error::InvalidArgument(kWhat);
  auto job = std::make_shared<Rows4Job>();
  job->x = x.typed_data(), job->M = xd[0], job->I = xd[1], job->q8 = q8;
  // scratch that outlives the units (RunUnits waits for them)
  thread_local std::vector<int8_t> xq;
  thread_local std::vector<float> dxe, c;
  if (q8) {
    xq.resize(job->M * Q8Bytes(job->I)), dxe.resize(job->M * Q8Lanes(job->I));
    c.resize(job->M * Q8Mins(job->I));
    QuantiseQ8(job->x, job->M, job->I, xq.data(), dxe.data(), c.data());
    job->xq = xq.data(), job->dxe = dxe.data(), job->c = c.data();
  }
  thread_local std::vector<float> rounded;
  if (activations == Activations::kBfloat16) {
    const int64_t n = job->M * job->I;
    if (rounded.size() < size_t(n)) rounded.resize(n);
    RoundBf16s(job->x, n, rounded.data());
    job->x = rounded.data();
#if defined(__AVX512BF16__)
    thread_local std::vector<uint16_t> xb;
    thread_local std::vector<float> sx;
    xb.resize(job->M * Bf16Words(job->I)), sx.resize(job->M * Bf16Sums(job->I));
    SplitBf16(job->x, job->M, job->I, xb.data(), sx.data());
    job->bf16 = true, job->xb = xb.data(), job->sx = sx.data();
#elif defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
    thread_local std::vector<float> halves, sx;
    halves.resize(n), sx.resize(job->M * Bf16Sums(job->I));
    SplitBf16Halves(job->x, job->M, job->I, halves.data(), sx.data());
    job->bf16 = true, job->x = halves.data(), job->sx = sx.data();
#endif
  }
#if defined(__AVX512F__)
  thread_local std::vector<float> split;
  if (!q8 && !job->bf16) {
    if (split.size() < size_t(job->M * job->I)) split.resize(job->M * job->I);
    SplitEvenOdd(job->x, job->M, job->I, split.data());
    job->x = split.data();
  }
#endif
  const int64_t threads = 1 + GetHelpers()->threads;  // who may share the units
  size_t bytes = 0;
  for (size_t k = 0; k < rets.size(); ++k) {
    Rows4Part part{};
    if (!ReadInt4(args, rets, k, job->M, job->I, part)) return ffi::Error::InvalidArgument(kWhat);
    const int64_t O = part.O, G = job->I / kGroup4;
    const bool symmetric = part.symmetric;
    part.first_unit = job->units, part.unit_rows = UnitRows4(O, job->I, threads);
    if (job->M > 0) job->units += (O + part.unit_rows - 1) / part.unit_rows;
    job->parts.push_back(part);
    const size_t field = part.d != nullptr ? 4 : 2;  // a scale's or a minimum's bytes
    bytes += size_t(O) * size_t(job->I) / 2 + size_t(O * G) * field * (symmetric ? 1 : 2);
  }
  if (job->I == 0)
    for (auto& part : job->parts) std::fill(part.y, part.y + job->M * part.O, 0.0f);
  else
    RunUnits(job, bytes >= kShareBytes);
  return ffi::Error::Success();
}

ffi::Error MatvecInt4Rows(ffi::Buffer<ffi::F32> x, ffi::RemainingArgs args,
                          ffi::RemainingRets rets) {
  return Int4Rows(x, args, rets, Activations::kFloat32);
}

ffi::Error MatvecInt4Q8Rows(ffi::Buffer<ffi::F32> x, ffi::RemainingArgs args,
                            ffi::RemainingRets rets) {
  return Int4Rows(x, args, rets, Activations::kInt8);
}

ffi::Error MatvecInt4Bf16Rows(ffi::Buffer<ffi::F32> x, ffi::RemainingArgs args,
                              ffi::RemainingRets rets) {
  return Int4Rows(x, args, rets, Activations::kBfloat16);
}

// -- 4-bit weights times a prompt's rows, bfloat16 activations: "jax_llama_prompt_int4_bf16" ---
//
// y_k (M, O_k) = x' @ W_k^T for many rows of x (a prompt: tens to thousands), x' = x rounded to
// bfloat16 (RoundBf16) and W = q d + m as "jax_llama_matvec_int4_bf16" takes them: the same
// numbers to float32 rounding. There the rows of x are few and the weights stream from memory
// once; here each weight is read M times, so the speed is the arithmetic's: a 2-core AMD EPYC
// Zen 4's float32 multiply-adds top out near 180 GFLOP/s (XLA's dot), less than llama.cpp's
// prompt on the same weights, and vdpbf16ps does twice their products.
//
// Work: the output rows are cut into units of kPromptRows (two vectors of 16 rows), shared with
// the helpers. A unit takes the inputs kPromptDepth at a time: its 4-bit weights for those inputs
// are expanded once into bfloat16 pairs (PackPromptPanel: a vector holds 16 rows' weights for two
// adjacent inputs, q exactly, or q - 8 where m = -8 d), then every tile of kPromptTile rows of x
// runs over them (PromptTile), x' broadcast two inputs at a time. Each group of 32 inputs is
// summed apart (16 vdpbf16ps per lane, exact products), then scaled into the output:
//   y = fma(sum_g, d_g, y), then fma(sum x'_g, m_g, y) where m is not -8 d,
// group after group in input order, whatever the tile, the unit or the threads: a row of x gets
// the same bits alone or in any prompt.
#if defined(__AVX512BF16__)
constexpr int kPromptVectors = 2;                  // vectors of 16 output rows in a unit
constexpr int64_t kPromptRows = 16 * kPromptVectors;
constexpr int kPromptTile = 4;                     // rows of x multiplied at a time
constexpr int64_t kPromptDepth = 256;              // inputs a unit expands at a time (8 groups)

struct PromptPart {
  const uint8_t* q = nullptr;  // 4-bit rows (O, I / 2); or, for int8 weights:
  const int8_t* q8 = nullptr;  // int8 (I, O), as "jax_llama_matvec_int8" takes them, and
  const float* s8 = nullptr;   // their scales (G, O): a row per rows8 inputs (G = 1: per output)
  int64_t rows8 = 0;
  const float *d = nullptr, *m = nullptr;
  const uint16_t *dh = nullptr, *mh = nullptr;
  bool symmetric = false;
  float* y;
  int64_t O, first_unit;
};

struct PromptJob {
  const uint16_t* xb;  // (M, I): x' as bfloat16 bits
  const float* sx;     // (M, G): each group's sum of x' (asymmetric weights only)
  int64_t M, I, units = 0;
  std::vector<PromptPart> parts;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

// bfloat16 bits of 16 small integers (exact: at most 8 significant bits)
inline __m512i IntsToBf16(__m512i v) {
  return _mm512_srli_epi32(_mm512_castps_si512(_mm512_cvtepi32_ps(v)), 16);
}

// Rows [o, o + kPromptRows) of a part, inputs [i0, i0 + n): w (n / 2 pairs x kPromptVectors
// vectors, lane l of vector v = row o + 16 v + l, its low word input 2 p, its high word 2 p + 1)
// and the groups' scales and minima, ds and ms (n / 32 groups x kPromptRows); rows past O zero.
void PackPromptPanel(const PromptPart& p, int64_t I, int64_t o, int64_t i0, int64_t n,
                     uint32_t* w, float* ds, float* ms) {
  const int64_t J = I / 2, G = I / kGroup4, g0 = i0 / kGroup4, groups = n / kGroup4;
  const __m512i f = _mm512_set1_epi32(0x0F), eight = _mm512_set1_epi32(p.symmetric ? 8 : 0);
  for (int v = 0; v < kPromptVectors; ++v) {
    const int64_t rows = std::clamp<int64_t>(p.O - (o + 16 * v), 0, 16);
    const __mmask16 in = static_cast<__mmask16>((1u << rows) - 1);
    // lane l's byte offsets: row o + 16 v + l (rows past O: row o, masked)
    alignas(64) int32_t at[16];
    for (int l = 0; l < 16; ++l) at[l] = static_cast<int32_t>(l < rows ? (16 * v + l) * J : 0);
    const __m512i offsets = _mm512_load_si512(at);
    const uint8_t* base = p.q + o * J + i0 / 2;
    for (int64_t b = 0; b < n / 2; ++b) {  // byte b: inputs i0 + 2 b (low nibble), + 1 (high)
      const __m512i bytes = _mm512_and_si512(
          _mm512_mask_i32gather_epi32(_mm512_setzero_si512(), in, offsets, base + b, 1),
          _mm512_set1_epi32(0xFF));
      const __m512i lo = IntsToBf16(_mm512_sub_epi32(_mm512_and_si512(bytes, f), eight));
      const __m512i hi = IntsToBf16(_mm512_sub_epi32(_mm512_srli_epi32(bytes, 4), eight));
      _mm512_storeu_si512(w + (b * kPromptVectors + v) * 16,
                          _mm512_maskz_or_epi32(in, lo, _mm512_slli_epi32(hi, 16)));
    }
    for (int64_t g = 0; g < groups; ++g)
      for (int l = 0; l < 16; ++l) {
        const int64_t row = o + 16 * v + l, at_g = row * G + g0 + g;
        float dv = 0.0f, mv = 0.0f;
        if (l < rows) {
          dv = p.dh != nullptr ? HalfToFloat(p.dh[at_g]) : p.d[at_g];
          if (!p.symmetric) mv = p.mh != nullptr ? HalfToFloat(p.mh[at_g]) : p.m[at_g];
        }
        ds[g * kPromptRows + 16 * v + l] = dv, ms[g * kPromptRows + 16 * v + l] = mv;
      }
  }
}

// PackPromptPanel's w and ds for int8 weights Q (I, O) and scales s: lane l of vector v holds
// Q[i0 + 2 p, o + 16 v + l] and Q[i0 + 2 p + 1, ...] (bfloat16, exact), a group's scales the
// row of s its inputs belong to; two strided loads of 16 bytes a pair (a prompt's time is its
// products).
void PackPromptPanel8(const PromptPart& p, int64_t o, int64_t i0, int64_t n, uint32_t* w,
                      float* ds) {
  const int64_t O = p.O;
  for (int v = 0; v < kPromptVectors; ++v) {
    const int64_t rows = std::clamp<int64_t>(O - (o + 16 * v), 0, 16);
    const __mmask16 in = static_cast<__mmask16>((1u << rows) - 1);
    const int8_t* column = p.q8 + o + 16 * v;
    for (int64_t b = 0; b < n / 2; ++b) {
      const int8_t* at = column + (i0 + 2 * b) * O;
      const __m512i lo = IntsToBf16(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(in, at)));
      const __m512i hi = IntsToBf16(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(in, at + O)));
      _mm512_storeu_si512(w + (b * kPromptVectors + v) * 16,
                          _mm512_or_si512(lo, _mm512_slli_epi32(hi, 16)));
    }
    for (int64_t g = 0; g < n / kGroup4; ++g)
      _mm512_storeu_ps(ds + g * kPromptRows + 16 * v,
                       _mm512_maskz_loadu_ps(in, p.s8 + (i0 + g * kGroup4) / p.rows8 * O + o + 16 * v));
  }
}

// Rows [t0, t0 + T) of x over a packed panel (inputs [i0, i0 + n)) into y's rows
// [o, o + kPromptRows): the first panel starts the sums, later ones load them back.
template <int T>
void PromptTile(const PromptJob& j, const PromptPart& p, int64_t o, int64_t t0, int64_t i0,
                int64_t n, const uint32_t* w, const float* ds, const float* ms) {
  constexpr int V = kPromptVectors;
  const int64_t I = j.I, G = I / kGroup4, g0 = i0 / kGroup4;
  __mmask16 keep[V];
  for (int v = 0; v < V; ++v)
    keep[v] = static_cast<__mmask16>((1u << std::clamp<int64_t>(p.O - (o + 16 * v), 0, 16)) - 1);
  Vec y[T][V];
  for (int t = 0; t < T; ++t)
    for (int v = 0; v < V; ++v)
      y[t][v] = i0 == 0 ? Splat(0.0f)
                        : _mm512_maskz_loadu_ps(keep[v], p.y + (t0 + t) * p.O + o + 16 * v);
  for (int64_t g = 0; g < n / kGroup4; ++g) {
    Vec s[T][V];
    for (int t = 0; t < T; ++t)
      for (int v = 0; v < V; ++v) s[t][v] = Splat(0.0f);
    const uint32_t* wg = w + g * 16 * V * 16;
    for (int pair = 0; pair < 16; ++pair) {
      __m512i wv[V];
      for (int v = 0; v < V; ++v) wv[v] = _mm512_loadu_si512(wg + (pair * V + v) * 16);
      for (int t = 0; t < T; ++t) {
        uint32_t two;
        std::memcpy(&two, j.xb + (t0 + t) * I + i0 + g * kGroup4 + 2 * pair, sizeof(two));
        const __m512bh xv = (__m512bh)_mm512_set1_epi32(static_cast<int>(two));
        for (int v = 0; v < V; ++v) s[t][v] = _mm512_dpbf16_ps(s[t][v], (__m512bh)wv[v], xv);
      }
    }
    for (int v = 0; v < V; ++v) {
      const Vec dv = Load(ds + g * kPromptRows + 16 * v);
      for (int t = 0; t < T; ++t) y[t][v] = Fma(s[t][v], dv, y[t][v]);
    }
    if (!p.symmetric)
      for (int v = 0; v < V; ++v) {
        const Vec mv = Load(ms + g * kPromptRows + 16 * v);
        for (int t = 0; t < T; ++t)
          y[t][v] = Fma(Splat(j.sx[(t0 + t) * G + g0 + g]), mv, y[t][v]);
      }
  }
  for (int t = 0; t < T; ++t)
    for (int v = 0; v < V; ++v)
      _mm512_mask_storeu_ps(p.y + (t0 + t) * p.O + o + 16 * v, keep[v], y[t][v]);
}

void RunUnit(const PromptJob& j, int64_t u) {
  size_t k = 0;
  while (k + 1 < j.parts.size() && u >= j.parts[k + 1].first_unit) ++k;
  const PromptPart& p = j.parts[k];
  const int64_t o = (u - p.first_unit) * kPromptRows;
  thread_local std::vector<uint32_t> w(kPromptDepth / 2 * kPromptRows);
  thread_local std::vector<float> ds(kPromptDepth / kGroup4 * kPromptRows),
      ms(kPromptDepth / kGroup4 * kPromptRows);
  for (int64_t i0 = 0; i0 < j.I; i0 += kPromptDepth) {
    const int64_t n = std::min(kPromptDepth, j.I - i0);
    if (p.q8 != nullptr)
      PackPromptPanel8(p, o, i0, n, w.data(), ds.data());
    else
      PackPromptPanel(p, j.I, o, i0, n, w.data(), ds.data(), ms.data());
    int64_t t0 = 0;
    for (; t0 + kPromptTile <= j.M; t0 += kPromptTile)
      PromptTile<kPromptTile>(j, p, o, t0, i0, n, w.data(), ds.data(), ms.data());
    for (; t0 < j.M; ++t0) PromptTile<1>(j, p, o, t0, i0, n, w.data(), ds.data(), ms.data());
  }
}
#endif

#if defined(__AVX512BF16__)
// x' as bfloat16 bits, and each group's sum of x' where a part has minima (a fixed tree over
// its two vectors), a row at a time; held for this call only (a long prompt's x' is as big as a
// third of x); then the units, shared with the helpers.
void RunPrompt(const std::shared_ptr<PromptJob>& job, const float* x, bool asymmetric) {
  const int64_t M = job->M, I = job->I, G = I / kGroup4;
  if (I == 0 || M == 0) {
    for (auto& part : job->parts) std::fill(part.y, part.y + M * part.O, 0.0f);
    return;
  }
  std::vector<uint16_t> xb(M * I);
  std::vector<float> sx(asymmetric ? M * G : 0);
  thread_local std::vector<float> row;
  row.resize(I);
  for (int64_t r = 0; r < M; ++r) {
    RoundBf16s(x + r * I, I, row.data());
    for (int64_t i = 0; i < I; ++i) {
      uint32_t u;
      std::memcpy(&u, &row[i], sizeof(u));
      xb[r * I + i] = static_cast<uint16_t>(u >> 16);
    }
    if (asymmetric)
      for (int64_t g = 0; g < G; ++g)
        sx[r * G + g] = HorizontalSum(Add(Load(row.data() + g * kGroup4),
                                          Load(row.data() + g * kGroup4 + kLanes)));
  }
  job->xb = xb.data(), job->sx = sx.data();
  RunUnits(job, true);
}
#endif

ffi::Error PromptInt4Bf16(ffi::Buffer<ffi::F32> x, ffi::RemainingArgs args,
                          ffi::RemainingRets rets) {
#if defined(__AVX512BF16__)
  constexpr const char* kWhat =
      "prompt_int4_bf16: expected x (M, I), then (q (O, I / 2) uint8, scale (O, I / 32) and min "
      "(O, I / 32) or (0,): none, m = -8 scale; both float32 or both float16) per output y "
      "(M, O); I a multiple of 32";
  auto xd = x.dimensions();
  if (xd.size() != 2 || xd[1] % kGroup4 || rets.size() == 0 || args.size() != 3 * rets.size())
    return ffi::Error::InvalidArgument(kWhat);
  auto job = std::make_shared<PromptJob>();
  job->M = xd[0], job->I = xd[1];
  bool asymmetric = false;
  for (size_t k = 0; k < rets.size(); ++k) {
    PromptPart part;
    if (!ReadInt4(args, rets, k, job->M, job->I, part)) return ffi::Error::InvalidArgument(kWhat);
    part.first_unit = job->units;
    asymmetric |= !part.symmetric;
    job->units += (part.O + kPromptRows - 1) / kPromptRows;
    job->parts.push_back(part);
  }
  RunPrompt(job, x.typed_data(), asymmetric);
  return ffi::Error::Success();
#else
  return Int4Rows(x, args, rets, Activations::kBfloat16);
#endif
}

// -- int8 weights times a prompt's rows, bfloat16 activations: "jax_llama_prompt_int8_bf16" ----
//
// y_k (M, O_k) = x' @ (Q_k * s_k) for int8 Q (I, O) with scales (G, O), one row per I / G
// inputs (G = 1: one scale an output; as "jax_llama_matvec_int8" takes them), x' = x rounded to
// bfloat16: the 4-bit prompt kernel's units and tiles, each pair of Q's rows expanded to
// bfloat16 (exact: at most 8 significant bits) and every group of 32 inputs' exact sum scaled
// by its scale into y, in input order. Libraries without bfloat16 products refuse it
// (kernels.prompt_bf16 says which).
ffi::Error PromptInt8Bf16(ffi::Buffer<ffi::F32> x, ffi::RemainingArgs args,
                          ffi::RemainingRets rets) {
  constexpr const char* kWhat =
      "prompt_int8_bf16: expected x (M, I), then (q (I, O) int8, scale (G, O) float32, I / G a "
      "multiple of 32) per output y (M, O); a library built with AVX512_BF16";
#if defined(__AVX512BF16__)
  auto xd = x.dimensions();
  if (xd.size() != 2 || xd[1] % kGroup4 || rets.size() == 0 || args.size() != 2 * rets.size())
    return ffi::Error::InvalidArgument(kWhat);
  auto job = std::make_shared<PromptJob>();
  job->M = xd[0], job->I = xd[1];
  for (size_t k = 0; k < rets.size(); ++k) {
    auto q = args.get<ffi::Buffer<ffi::S8>>(2 * k);
    auto s = args.get<ffi::Buffer<ffi::F32>>(2 * k + 1);
    auto y = rets.get<ffi::Buffer<ffi::F32>>(k);
    if (!q.has_value() || !s.has_value() || !y.has_value())
      return ffi::Error::InvalidArgument(kWhat);
    auto qd = q->dimensions(), yd = (*y)->dimensions();
    if (qd.size() != 2 || qd[0] != job->I || yd.size() != 2 || yd[0] != job->M ||
        yd[1] != qd[1])
      return ffi::Error::InvalidArgument(kWhat);
    const int64_t O = qd[1], n = s->element_count(), G = O > 0 ? n / O : 1;
    if (O == 0 ? n != 0 : (n % O != 0 || G == 0 || job->I % G != 0 || job->I / G % kGroup4))
      return ffi::Error::InvalidArgument(kWhat);
    PromptPart part;
    part.q8 = q->typed_data(), part.s8 = s->typed_data(), part.symmetric = true;
    part.rows8 = std::max<int64_t>(1, job->I / G);
    part.y = (*y)->typed_data(), part.O = qd[1], part.first_unit = job->units;
    job->units += (part.O + kPromptRows - 1) / kPromptRows;
    job->parts.push_back(part);
  }
  RunPrompt(job, x.typed_data(), false);
  return ffi::Error::Success();
#else
  return ffi::Error::InvalidArgument(kWhat);
#endif
}

// -- attention of a few queries over a KV cache ------------------------------------------------
//
//   out (B, K, G, S, H) = softmax(q k^T / sqrt(H) + mask) v, reading keys and values of layer l
//   in place from the cache (L, B, K, T, H)                           "jax_llama_decode_attention"
//
// What XLA does at a decode step is a dozen small operations a layer (the cache sliced and
// transposed, two batched matmuls, the softmax's passes), each costing more to start than to
// run; this is one call. The mask is the model's: query s sees slot t when t <= q_slots[s] and
// valid[b, t]. A masked score is the most negative float32 (as jax_llama.attention's xla), and
// masked slots are not read at all, so a long cache costs only its filled slots. A unit is one
// (row, kv head): its G query heads times S queries against that head's slots.
//
// Arithmetic, per query: each score a dot product in vector lanes added by a fixed tree, then
// divided by sqrt(H); the softmax as jax.nn.softmax does it (the maximum, exp(score - max), their
// sum in lanes added by a fixed tree, each divided by the sum); then the probabilities times the
// values, one fused multiply-add per slot in slot order. Nothing depends on B or on the threads.

constexpr float kMasked = -3.4028234663852886e38f;  // numpy's float32 min, jax_llama.attention

// exp for the softmax: e^x = 2^n e^r, r = x - n ln 2 in two parts (Cody and Waite), e^r by a
// degree-7 polynomial (1 to 2 ulp over float32); below -87 it is 0 (what softmax needs of the
// masked slots, which it reaches with -3.4e38).
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
inline Vec Exp(Vec x) {
#if defined(__AVX512F__)
  const __mmask16 tiny = _mm512_cmp_ps_mask(x, Splat(-87.0f), _CMP_LT_OQ);
  x = _mm512_min_ps(_mm512_max_ps(x, Splat(-87.0f)), Splat(88.0f));
  Vec n = _mm512_roundscale_ps(Mul(x, Splat(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT);
#else
  const __m256 tiny = _mm256_cmp_ps(x, Splat(-87.0f), _CMP_LT_OQ);
  x = _mm256_min_ps(_mm256_max_ps(x, Splat(-87.0f)), Splat(88.0f));
  Vec n = _mm256_round_ps(Mul(x, Splat(1.44269504088896341f)),
                          _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
#endif
  Vec r = Fma(n, Splat(-0.693359375f), x);
  r = Fma(n, Splat(2.12194440e-4f), r);
  Vec p = Splat(1.9875691500e-4f);
  p = Fma(p, r, Splat(1.3981999507e-3f));
  p = Fma(p, r, Splat(8.3334519073e-3f));
  p = Fma(p, r, Splat(4.1665795894e-2f));
  p = Fma(p, r, Splat(1.6666665459e-1f));
  p = Fma(p, r, Splat(5.0000001201e-1f));
  p = Fma(p, Mul(r, r), Add(r, Splat(1.0f)));
#if defined(__AVX512F__)
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~tiny), _mm512_scalef_ps(p, n));
#else
  __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(tiny, Mul(p, _mm256_castsi256_ps(e)));
#endif
}
#else
inline Vec Exp(Vec x) { return x < -87.0f ? 0.0f : std::exp(x); }
#endif
// The same for one value (the slots past the last full vector), through a vector's first lane.
inline float ExpS(float x) {
#if defined(__AVX512F__)
  return _mm512_cvtss_f32(Exp(_mm512_set1_ps(x)));
#elif defined(__AVX2__) && defined(__FMA__)
  return _mm256_cvtss_f32(Exp(_mm256_set1_ps(x)));
#else
  return Exp(x);
#endif
}

struct AttentionJob {
  const float *q, *k, *v;  // q (B, K, G, S, H); k, v: layer l of the cache, (B, K, T, H)
  const int32_t* q_slots;  // (S,)
  const bool* valid;       // (B, T)
  float* out;              // (B, K, G, S, H)
  int64_t B, K, G, S, T, H, units = 0;
  std::atomic<int64_t> next{0};
  std::atomic<int64_t> done{0};
};

// The dot product of two H-vectors: lanes, a fixed tree, then the tail in order.
inline float Dot(const float* a, const float* b, int64_t H) {
  int64_t h = 0;
  float sum = 0.0f;
  if (H >= kLanes) {
    Vec acc = Mul(Load(a), Load(b));
    for (h = kLanes; h + kLanes <= H; h += kLanes) acc = Fma(Load(a + h), Load(b + h), acc);
    sum = HorizontalSum(acc);
  }
  for (; h < H; ++h) sum = std::fma(a[h], b[h], sum);
  return sum;
}

void RunUnit(const AttentionJob& j, int64_t u) {
  const int64_t b = u / j.K, T = j.T, H = j.H, R = j.G * j.S;
  const float* k = j.k + u * T * H;
  const float* v = j.v + u * T * H;
  const bool* valid = j.valid + b * T;
  const float* q = j.q + u * R * H;  // (G, S, H) of this (row, kv head)
  float* out = j.out + u * R * H;
  const float sqrt_h = static_cast<float>(std::sqrt(static_cast<double>(H)));
  thread_local std::vector<float> scores;
  if (scores.size() < size_t(T)) scores.resize(T);
  float* p = scores.data();
  for (int64_t r = 0; r < R; ++r) {
    const int64_t slot = j.q_slots[r % j.S];
    const float* qr = q + r * H;
    // Slots past the query's own are masked (causal), and a masked slot's probability is an
    // exact 0 once a slot is not masked: then only the first n slots are needed, n the slot's
    // own rounded up to whole vectors (so each slot keeps its lane in the sum, and the bits are
    // those of all T). A decode step in a long cache (8,192 slots for LLaMA 3 8B's 8k context)
    // reads its few filled slots, not all T. With no slot to see, all T: their uniform average.
    int64_t n = std::min(T, (std::max<int64_t>(slot, 0) / kLanes + 1) * kLanes);
    bool seen = false;
    for (int64_t t = 0; t < n && t <= slot && !seen; ++t) seen = valid[t];
    if (!seen) n = T;
    float top = kMasked;
    for (int64_t t = 0; t < n; ++t) {
      p[t] = (t <= slot && valid[t]) ? Dot(qr, k + t * H, H) / sqrt_h : kMasked;
      top = std::max(top, p[t]);
    }
    int64_t t = 0;
    float sum = 0.0f;
    if (n >= kLanes) {
      Vec acc = Splat(0.0f);
      for (; t + kLanes <= n; t += kLanes) {
        Vec e = Exp(Add(Load(p + t), Splat(-top)));
        Store(p + t, e);
        acc = Add(acc, e);
      }
      sum = HorizontalSum(acc);
    }
    for (; t < n; ++t) sum += (p[t] = ExpS(p[t] - top));
    // Probabilities times values: out = the sum over slots of p[t] v[t], in slot order, slots
    // whose probability is 0 (the masked ones, when any slot is not) skipped.
    float* o = out + r * H;
    std::fill(o, o + H, 0.0f);
    for (t = 0; t < n; ++t) {
      const float pt = p[t] / sum;
      if (pt == 0.0f) continue;
      const float* vt = v + t * H;
      int64_t h = 0;
      for (; h + kLanes <= H; h += kLanes) Store(o + h, Fma(Splat(pt), Load(vt + h), Load(o + h)));
      for (; h < H; ++h) o[h] = std::fma(pt, vt[h], o[h]);
    }
  }
}

bool Same(ffi::Span<const int64_t> a, ffi::Span<const int64_t> b) {
  return a.size() == b.size() && std::equal(a.begin(), a.end(), b.begin());
}

ffi::Error DecodeAttention(ffi::Buffer<ffi::F32> q, ffi::Buffer<ffi::F32> k_cache,
                           ffi::Buffer<ffi::F32> v_cache, ffi::Buffer<ffi::S32> layer,
                           ffi::Buffer<ffi::S32> q_slots, ffi::Buffer<ffi::PRED> valid,
                           ffi::ResultBuffer<ffi::F32> out) {
  auto qd = q.dimensions(), kd = k_cache.dimensions();
  if (qd.size() != 5 || kd.size() != 5 || !Same(v_cache.dimensions(), kd) || kd[1] != qd[0] ||
      kd[2] != qd[1] || kd[4] != qd[4] || !Same(out->dimensions(), qd) ||
      q_slots.element_count() != qd[3] || valid.dimensions().size() != 2 ||
      valid.dimensions()[0] != qd[0] || valid.dimensions()[1] != kd[3] ||
      layer.element_count() != 1)
    return ffi::Error::InvalidArgument(
        "decode_attention: expected q (B, K, G, S, H), caches (L, B, K, T, H), layer (), "
        "q_slots (S,), valid (B, T)");
  const int64_t l = layer.typed_data()[0];
  if (l < 0 || l >= kd[0]) return ffi::Error::InvalidArgument("decode_attention: layer out of range");
  auto job = std::make_shared<AttentionJob>();
  const int64_t per_layer = kd[1] * kd[2] * kd[3] * kd[4];
  job->q = q.typed_data(), job->k = k_cache.typed_data() + l * per_layer;
  job->v = v_cache.typed_data() + l * per_layer;
  job->q_slots = q_slots.typed_data(), job->valid = valid.typed_data();
  job->out = out->typed_data();
  job->B = qd[0], job->K = qd[1], job->G = qd[2], job->S = qd[3], job->T = kd[3], job->H = qd[4];
  job->units = job->B * job->K;
  if (job->G * job->S == 0 || job->H == 0) job->units = 0;
  RunUnits(job, size_t(2) * per_layer * sizeof(float) >= kShareBytes);
  return ffi::Error::Success();
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxLlamaMatvecF32, MatvecF32,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .RemainingArgs()
                                  .RemainingRets());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxLlamaMatvecInt8, MatvecInt8,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .RemainingArgs()
                                  .RemainingRets());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxLlamaMatvecInt4, MatvecInt4Rows,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .RemainingArgs()
                                  .RemainingRets());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxLlamaMatvecInt4Q8, MatvecInt4Q8Rows,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .RemainingArgs()
                                  .RemainingRets());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxLlamaMatvecInt4Bf16, MatvecInt4Bf16Rows,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .RemainingArgs()
                                  .RemainingRets());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxLlamaPromptInt4Bf16, PromptInt4Bf16,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .RemainingArgs()
                                  .RemainingRets());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxLlamaPromptInt8Bf16, PromptInt8Bf16,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .RemainingArgs()
                                  .RemainingRets());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxLlamaMatvecInt8Rows, MatvecInt8Rows,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S8>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxLlamaDecodeAttention, DecodeAttention,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::PRED>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JaxLlamaMatvecF32Rows, MatvecF32Rows,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

// The vector width the library was built for (16, 8 or 1 lanes of float32).
extern "C" int jax_llama_matvec_lanes() { return static_cast<int>(kLanes); }

// Whether "jax_llama_prompt_int4_bf16" and "jax_llama_prompt_int8_bf16" multiply bfloat16 pairs
// (AVX512_BF16); elsewhere the first runs "jax_llama_matvec_int4_bf16"'s kernel, slower on a
// prompt than XLA's dot, and the second refuses.
extern "C" int jax_llama_prompt_bf16() {
#if defined(__AVX512BF16__)
  return 1;
#else
  return 0;
#endif
}

