// InfiniGen's two hot loops on the CPU, each one pass over memory instead of a chain of eager ops.
//
//   rehearse_select: rehearsed logits of every past slot against the partial keys, the paper's alpha count,
//     each KV head's query-group sum of softmax weights, and its top-k slots (partitioned, not sorted: the
//     first `kept` slots are the `kept` best, which is all the alpha mask needs). With a `width` > k the heads
//     share kv x k rows: each head's best `width`, its share of the kv x k best of them first, a mask per head.
//   attend_rows: one token's grouped-query attention over pool rows picked by slot, read where they lie
//     (no gathered copy), split into chunks that are combined by their softmax maxima and sums; a mask per
//     head leaves each head its own count of rows.
// And two products for decoding (weights.py), one float32 row times a weight at a GGUF file's own codes in groups
// of 32 input channels: q8_matvec, int8 codes with a float32 scale each (Q8_0), one byte per weight; q4_matvec,
// 4-bit codes two a byte with a float32 scale and minimum each (Q4_1), the row never rounded to bf16.
//
// Built at run time by infinigen_core/cpu_kernels.py (torch.utils.cpp_extension); float32 rows and queries
// (partial keys float32, float16, or int8 codes with a power-of-two scale per slot: policies/partial_codes.py),
// anything else keeps the eager path. Both parallelise with ATen's own thread pool, never a second one.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#if defined(__AVX512F__) || defined(__F16C__) || defined(__AVX2__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

namespace {

constexpr int64_t kMaxGroup = 16;  // query heads per KV head
constexpr int64_t kMaxDim = 256;   // head or partial dimension
constexpr int64_t kSlotBlock = 256;
constexpr int64_t kRowChunk = 256;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

// e^x for x <= 0, branch-free so that loops over it vectorise: x = n ln2 + t with |t| <= ln2 / 2 (ln2 split
// in two so that n ln2 stays exact), e^t by its Taylor series to t^7 (relative error below 2e-7), 2^n through
// the exponent bits. Below -87 it returns 0 (float32 would be denormal there).
inline float exp_nonpositive(float x) {
  const bool underflow = x < -87.0f;
  x = underflow ? -87.0f : x;
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float t = (x - n * 0.693145751953125f) - n * 1.42860682030941723212e-6f;
  float p = 1.0f / 5040.0f;
  p = p * t + 1.0f / 720.0f;
  p = p * t + 1.0f / 120.0f;
  p = p * t + 1.0f / 24.0f;
  p = p * t + 1.0f / 6.0f;
  p = p * t + 0.5f;
  p = p * t + 1.0f;
  p = p * t + 1.0f;
  const float scale = __builtin_bit_cast(float, (static_cast<int32_t>(n) + 127) << 23);
  return underflow ? 0.0f : p * scale;
}

// Reductions written over 16 lanes, so that the compiler vectorises them without reassociating on its own.
constexpr int kLanes = 16;

inline float max_of(const float* x, int64_t n) {
  float lanes[kLanes];
  std::fill(lanes, lanes + kLanes, kNegInf);
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes)
    for (int l = 0; l < kLanes; ++l) lanes[l] = std::max(lanes[l], x[j + l]);
  float result = kNegInf;
  for (int l = 0; l < kLanes; ++l) result = std::max(result, lanes[l]);
  for (; j < n; ++j) result = std::max(result, x[j]);
  return result;
}

inline float sum_of(const float* x, int64_t n) {
  float lanes[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes)
    for (int l = 0; l < kLanes; ++l) lanes[l] += x[j + l];
  float result = 0.0f;
  for (int l = 0; l < kLanes; ++l) result += lanes[l];
  for (; j < n; ++j) result += x[j];
  return result;
}

inline int64_t count_above(const float* x, int64_t n, float floor) {
  int32_t lanes[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes)
    for (int l = 0; l < kLanes; ++l) lanes[l] += x[j + l] > floor ? 1 : 0;
  int64_t result = 0;
  for (int l = 0; l < kLanes; ++l) result += lanes[l];
  for (; j < n; ++j) result += x[j] > floor ? 1 : 0;
  return result;
}

inline float dot(const float* a, const float* b, int64_t n) {
  float lanes[kLanes] = {};
  int64_t j = 0;
  for (; j + kLanes <= n; j += kLanes)
    for (int l = 0; l < kLanes; ++l) lanes[l] += a[j + l] * b[j + l];
  float result = 0.0f;
  for (int l = 0; l < kLanes; ++l) result += lanes[l];
  for (; j < n; ++j) result += a[j] * b[j];
  return result;
}

// out[j] += q * row[j]: float32 keys, or float16 ones (half the bytes to read) widened as they are loaded
inline void add_scaled(float* out, const float* row, int64_t n, float q) {
  for (int64_t j = 0; j < n; ++j) out[j] += q * row[j];
}

inline void add_scaled(float* out, const at::Half* row, int64_t n, float q) {
  int64_t j = 0;
#if defined(__AVX512F__)
  const __m512 scale = _mm512_set1_ps(q);
  for (; j + 16 <= n; j += 16) {
    const __m512 wide = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + j)));
    _mm512_storeu_ps(out + j, _mm512_fmadd_ps(scale, wide, _mm512_loadu_ps(out + j)));
  }
#elif defined(__F16C__) && defined(__FMA__)
  const __m256 scale = _mm256_set1_ps(q);
  for (; j + 8 <= n; j += 8) {
    const __m256 wide = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + j)));
    _mm256_storeu_ps(out + j, _mm256_fmadd_ps(scale, wide, _mm256_loadu_ps(out + j)));
  }
#endif
  for (; j < n; ++j) out[j] += q * static_cast<float>(row[j]);
}

// `kernel(std::integral_constant<int, G>{})` for a query group of G = 1..8 heads, the sizes whose logits the
// register kernels below hold (G x V sums: V = 4 vectors of 16 slots up to 4 heads, 2 above); 0 (nothing done)
// for larger groups
template <typename Kernel>
int64_t with_group_in_registers(int64_t group, Kernel&& kernel) {
  switch (group) {
    case 1: return kernel(std::integral_constant<int, 1>{});
    case 2: return kernel(std::integral_constant<int, 2>{});
    case 3: return kernel(std::integral_constant<int, 3>{});
    case 4: return kernel(std::integral_constant<int, 4>{});
    case 5: return kernel(std::integral_constant<int, 5>{});
    case 6: return kernel(std::integral_constant<int, 6>{});
    case 7: return kernel(std::integral_constant<int, 7>{});
    case 8: return kernel(std::integral_constant<int, 8>{});
    default: return 0;
  }
}

// The logits of a block's slots for a query group of G <= 8 heads, 32 or 64 slots at a time: the chunk's sums
// stay in registers over every channel, and each channel's 32 or 64 keys (one or two cache lines) are read
// and widened once for the whole group, where `add_scaled` reads and writes the sums in memory once per
// head and channel. The same products, added in the same channel order: the same logits, bit for bit. The
// channels' rows lie a whole cache apart, too many streams for the hardware prefetcher: each is asked for
// 512 bytes ahead. Returns where it stopped (a tail of under a chunk, or 0 without AVX-512 or for G > 8).
#if defined(__AVX512F__)
inline __m512 load_wide(const float* row) { return _mm512_loadu_ps(row); }
inline __m512 load_wide(const at::Half* row) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row)));
}

// V vectors of 16 slots per chunk: G x V sums in registers (at most 16 of the 32), each channel's V x 16 keys
// read as one run: V = 4 for groups of up to 4 heads (two cache lines of float16 keys per channel and visit,
// 0.77-0.84x the time of one line at Gemma 3's 32k shapes, docs/BENCHMARKS.md), V = 2 for larger groups
template <int G, int V, typename Key>
int64_t block_logits_in_registers(float* acc, const float* q, const Key* keys, int64_t channel_stride, int64_t r,
                                  int64_t n) {
  constexpr int64_t width = 16 * V;
  constexpr int64_t line_floats = 64 / sizeof(Key);
  constexpr int64_t lines = (width + line_floats - 1) / line_floats;
  int64_t j = 0;
  for (; j + width <= n; j += width) {
    __m512 sums[G][V];
    for (int g = 0; g < G; ++g)
      for (int v = 0; v < V; ++v) sums[g][v] = _mm512_setzero_ps();
    for (int64_t c = 0; c < r; ++c) {
      const Key* row = keys + c * channel_stride + j;
      const char* ahead = reinterpret_cast<const char*>(row) + 512;
      for (int64_t l = 0; l < lines; ++l) __builtin_prefetch(ahead + 64 * l);
      __m512 wide[V];
      for (int v = 0; v < V; ++v) wide[v] = load_wide(row + 16 * v);
      for (int g = 0; g < G; ++g) {
        const __m512 weight = _mm512_set1_ps(q[g * r + c]);
        for (int v = 0; v < V; ++v) sums[g][v] = _mm512_fmadd_ps(weight, wide[v], sums[g][v]);
      }
    }
    for (int g = 0; g < G; ++g)
      for (int v = 0; v < V; ++v) _mm512_storeu_ps(acc + g * kSlotBlock + j + 16 * v, sums[g][v]);
  }
  return j;
}

template <typename Key>
int64_t block_logits(float* acc, const float* q, const Key* keys, int64_t channel_stride, int64_t r, int64_t n,
                     int64_t group) {
  return with_group_in_registers(group, [&](auto size) {
    constexpr int G = decltype(size)::value;
    return block_logits_in_registers<G, G <= 4 ? 4 : 2>(acc, q, keys, channel_stride, r, n);
  });
}
#else
template <typename Key>
int64_t block_logits(float*, const float*, const Key*, int64_t, int64_t, int64_t, int64_t) { return 0; }
#endif

// ------------------------------------------------------------------------------ int8 keys, an int16 query
// int8 partial keys (codes with a power of two per slot, policies/partial_codes.py) are scored against the query
// rounded to 16-bit codes, each query head with its own power of two (`code_query`, partial_codes.query_codes in
// Python): a logit is the exact integer sum of the code products, converted to float32 once, times the head's
// power of two, times the slot's. Exact sums do not depend on the order of the additions, so the eager path
// (partial_codes.logits) gives the same logits to the bit, and the products can be taken two channels at a time
// by AVX-512's 16-bit multiply-adds (VNNI: 32 products an instruction, twice a float32 FMA's 16).

constexpr int32_t kQueryCodeLimit = 32767;  // with r <= kMaxDim channels of codes <= 127: sums well within int32
constexpr int kQueryExponentLimit = 100;     // powers of two far inside float32's normal range

// A query [heads, r] as codes, two channels to an int32 (channel 2p in the low half; an odd r's last pair has a
// zero for the exponent row it meets), and each head's power of two.
struct QueryCodes {
  std::vector<int16_t> codes;  // [heads, r]
  std::vector<int32_t> pairs;  // [heads, (r + 1) / 2]
  std::vector<float> powers;   // [heads]
  int64_t pairs_per_head;
};

QueryCodes code_query(const float* q, int64_t heads, int64_t r) {
  QueryCodes out{std::vector<int16_t>(heads * r), {}, std::vector<float>(heads), (r + 1) / 2};
  out.pairs.assign(heads * out.pairs_per_head, 0);
  for (int64_t h = 0; h < heads; ++h) {
    const float* row = q + h * r;
    float peak = 0.0f;
    for (int64_t c = 0; c < r; ++c) peak = std::max(peak, std::fabs(row[c]));
    int top = 0;  // peak = m * 2^top, m in [0.5, 1): the smallest power that keeps the peak's code <= 32767
    const float mantissa = std::frexp(peak, &top);
    int exponent = top - 15 + (std::nearbyint(std::ldexp(mantissa, 15)) > kQueryCodeLimit ? 1 : 0);
    exponent = std::clamp(exponent, -kQueryExponentLimit, kQueryExponentLimit);
    out.powers[h] = std::ldexp(1.0f, exponent);
    for (int64_t c = 0; c < r; ++c) {
      const float code = std::nearbyint(std::ldexp(row[c], -exponent));
      out.codes[h * r + c] = static_cast<int16_t>(std::clamp(code, -32767.0f, 32767.0f));
    }
    for (int64_t c = 0; c < r; ++c) {
      const uint32_t half = static_cast<uint16_t>(out.codes[h * r + c]);
      out.pairs[h * out.pairs_per_head + c / 2] |= static_cast<int32_t>(c % 2 == 0 ? half : half << 16);
    }
  }
  return out;
}

// Slots [j0, n) of a block one channel at a time, in plain int32 sums: the tail of a block, or all of it without
// AVX-512 (the same exact sums as the vector loop's)
void coded_logits_rows(float* acc, const int16_t* q_codes, const float* powers, const int8_t* keys,
                       int64_t channel_stride, int64_t r, int64_t j0, int64_t n, int64_t group) {
  std::vector<int32_t> sums(n - j0);
  for (int64_t g = 0; g < group; ++g) {
    std::fill(sums.begin(), sums.end(), 0);
    for (int64_t c = 0; c < r; ++c) {
      const int32_t code = q_codes[g * r + c];
      const int8_t* row = keys + c * channel_stride;
      for (int64_t j = j0; j < n; ++j) sums[j - j0] += code * static_cast<int32_t>(row[j]);
    }
    for (int64_t j = j0; j < n; ++j) acc[g * kSlotBlock + j] = static_cast<float>(sums[j - j0]) * powers[g];
  }
}

#if defined(__AVX512BW__)
inline __m512i add_pair_products(__m512i sums, __m512i query_pair, __m512i key_pairs) {
#if defined(__AVX512VNNI__)
  return _mm512_dpwssd_epi32(sums, query_pair, key_pairs);
#else
  return _mm512_add_epi32(sums, _mm512_madd_epi16(query_pair, key_pairs));
#endif
}

// Two channel rows' 16 * V slots as V vectors of 16 (channel c, channel c + 1) int16 pairs. Interleaving works
// within 128-bit lanes, so vectors 2u and 2u + 1 hold slots 32u + {0-7, 16-23} and 32u + {8-15, 24-31}.
template <int V>
inline void widen_channel_pair(const int8_t* first, const int8_t* second, __m512i* out) {
  if constexpr (V == 4) {
    const __m512i a = _mm512_loadu_si512(first), b = _mm512_loadu_si512(second);
    const __m512i low = _mm512_unpacklo_epi8(a, b), high = _mm512_unpackhi_epi8(a, b);
    out[0] = _mm512_cvtepi8_epi16(_mm512_castsi512_si256(low));
    out[1] = _mm512_cvtepi8_epi16(_mm512_castsi512_si256(high));
    out[2] = _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(low, 1));
    out[3] = _mm512_cvtepi8_epi16(_mm512_extracti64x4_epi64(high, 1));
  } else {
    static_assert(V == 2, "16 x 2 or 16 x 4 slots");
    const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(first));
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(second));
    out[0] = _mm512_cvtepi8_epi16(_mm256_unpacklo_epi8(a, b));
    out[1] = _mm512_cvtepi8_epi16(_mm256_unpackhi_epi8(a, b));
  }
}

// The int8 twin of block_logits_in_registers: G x V int32 sums over 16 * V slots held over every channel pair,
// each pair's rows read and widened once for the group; back in slot order, as floats times the head's power.
template <int G, int V>
int64_t coded_block_logits_in_registers(float* acc, const QueryCodes& query, int64_t first_head,
                                        const int8_t* keys, int64_t channel_stride, int64_t n) {
  constexpr int64_t width = 16 * V;
  const int64_t pairs = query.pairs_per_head;
  const int32_t* q_pairs = query.pairs.data() + first_head * pairs;
  const __m512i first_half = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23);
  const __m512i second_half = _mm512_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  int64_t j = 0;
  for (; j + width <= n; j += width) {
    __m512i sums[G][V];
    for (int g = 0; g < G; ++g)
      for (int v = 0; v < V; ++v) sums[g][v] = _mm512_setzero_si512();
    for (int64_t p = 0; p < pairs; ++p) {
      const int8_t* row = keys + 2 * p * channel_stride + j;
      __builtin_prefetch(row + 512);
      __builtin_prefetch(row + channel_stride + 512);
      __m512i wide[V];
      widen_channel_pair<V>(row, row + channel_stride, wide);
      for (int g = 0; g < G; ++g) {
        const __m512i query_pair = _mm512_set1_epi32(q_pairs[g * pairs + p]);
        for (int v = 0; v < V; ++v) sums[g][v] = add_pair_products(sums[g][v], query_pair, wide[v]);
      }
    }
    for (int g = 0; g < G; ++g) {
      const __m512 power = _mm512_set1_ps(query.powers[first_head + g]);
      float* out = acc + g * kSlotBlock + j;
      for (int u = 0; u < V / 2; ++u) {
        const __m512i low = _mm512_permutex2var_epi32(sums[g][2 * u], first_half, sums[g][2 * u + 1]);
        const __m512i high = _mm512_permutex2var_epi32(sums[g][2 * u], second_half, sums[g][2 * u + 1]);
        _mm512_storeu_ps(out + 32 * u, _mm512_mul_ps(_mm512_cvtepi32_ps(low), power));
        _mm512_storeu_ps(out + 32 * u + 16, _mm512_mul_ps(_mm512_cvtepi32_ps(high), power));
      }
    }
  }
  return j;
}

int64_t coded_block_logits(float* acc, const QueryCodes& query, int64_t first_head, const int8_t* keys,
                           int64_t channel_stride, int64_t n, int64_t group) {
  return with_group_in_registers(group, [&](auto size) {
    constexpr int G = decltype(size)::value;
    return coded_block_logits_in_registers<G, G <= 4 ? 4 : 2>(acc, query, first_head, keys, channel_stride, n);
  });
}
#else
int64_t coded_block_logits(float*, const QueryCodes&, int64_t, const int8_t*, int64_t, int64_t, int64_t) { return 0; }
#endif

// ---------------------------------------------------------------------------------------------- selection

// Puts the m largest of a[0, n) (distinct values) first and the others after them, in no particular order, as
// std::nth_element would, by a radix selection of the m-th largest: 11 bits at a time from the highest bit where
// the values differ, each pass counts the values per digit and passes on only those at the digit where the m-th
// largest lies (those above it are among the m, those below are not); after a pass or two a few dozen are left,
// which std::nth_element partitions. A last pass puts the values from the m-th largest up first. The passes only
// count and copy, where std::nth_element branches on every comparison, and near the boundary which way is a coin
// toss to the branch predictor (its partitions were most of the top-k's time at 8k). `scratch` holds 2n values.
constexpr int kDigitBits = 11;
constexpr int64_t kSmallPartition = 64;

// The m-th largest of a[0, n) (0 < m <= n), by the radix passes described above; `scratch` holds 2n values. Equal
// values may occur (two KV heads can hold the same weight at the same slot): they count as often as they occur.
inline uint64_t nth_largest(const uint64_t* a, int64_t n, int64_t m, uint64_t* scratch) {
  constexpr uint64_t mask = (uint64_t{1} << kDigitBits) - 1;
  uint64_t* buffers[2] = {scratch, scratch + n};
  int next = 0;
  // the `count` values the m-th largest of all is still among, as the `need`-th largest of them
  const uint64_t* values = a;
  int64_t count = n, need = m;
  while (need < count && count > kSmallPartition) {
    uint64_t low = values[0], high = values[0];
    for (int64_t i = 1; i < count; ++i) {
      low = std::min(low, values[i]);
      high = std::max(high, values[i]);
    }
    if (low == high) return low;  // every value left is the same one
    const int shift = std::max(0, 63 - __builtin_clzll(low ^ high) - (kDigitBits - 1));
    uint32_t counts[mask + 1] = {};
    for (int64_t i = 0; i < count; ++i) ++counts[(values[i] >> shift) & mask];
    uint64_t digit = mask;
    int64_t above = 0;
    while (above + counts[digit] < need) above += counts[digit--];
    uint64_t* out = buffers[next];
    int64_t passed = 0;
    for (int64_t i = 0; i < count; ++i) {  // written every time, kept where the digit matches: no branch
      out[passed] = values[i];
      passed += ((values[i] >> shift) & mask) == digit;
    }
    values = out;
    next ^= 1;
    count = passed;
    need -= above;
  }
  if (need == count) return *std::min_element(values, values + count);
  if (values == a) {  // too few for a pass: chosen among in scratch, `a` left as it is
    std::copy(a, a + count, scratch);
    values = scratch;
  }
  uint64_t* left = const_cast<uint64_t*>(values);  // a scratch buffer
  std::nth_element(left, left + (need - 1), left + count, std::greater<uint64_t>());
  return left[need - 1];
}

inline void put_largest_first(uint64_t* a, int64_t n, int64_t m, uint64_t* scratch) {
  if (m <= 0 || m >= n) return;
  if (n <= kSmallPartition) {
    std::nth_element(a, a + (m - 1), a + n, std::greater<uint64_t>());
    return;
  }
  const uint64_t nth = nth_largest(a, n, m, scratch);  // the m-th largest of all
  uint64_t* first = scratch;
  uint64_t* rest = scratch + n;
  int64_t firsts = 0, others = 0;
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t value = a[i];
    first[firsts] = value;
    firsts += value >= nth;
    rest[others] = value;
    others += value < nth;
  }
  std::copy(first, first + firsts, a);
  std::copy(rest, rest + others, a + firsts);
}

// Puts the k largest of x[0, n) (distinct values) first, in no particular order. Choosing among all n values
// costs most of a selection at long contexts; instead a sample of every 16th value gives a floor that, with a
// margin, about k values and a few more lie above: those are copied out in one pass with no branch (which value
// passes is a coin toss to the branch predictor: a branch per value cost twice the pass) and only they are
// chosen from. The result is exactly the k largest: where fewer than k lie above the floor (the margin was not
// enough), all n are chosen from as before.
// `scratch` holds at least largest_first_scratch(n) values.
constexpr int64_t kSampleStride = 16;
inline int64_t largest_first_scratch(int64_t n) { return n / kSampleStride + 3 * n; }

inline void largest_first(uint64_t* x, int64_t n, int64_t k, uint64_t* scratch) {
  constexpr int64_t kMinSample = 64;
  const int64_t samples = n / kSampleStride;
  if (samples >= kMinSample) {
    uint64_t* sample = scratch;
    uint64_t* picked = scratch + samples;
    for (int64_t i = 0; i < samples; ++i) sample[i] = x[i * kSampleStride];
    const double expected = static_cast<double>(k) * samples / n;  // sampled values among the k largest
    const int64_t rank = std::min<int64_t>(samples - 1, static_cast<int64_t>(expected + 3.0 * std::sqrt(expected) + 4.0));
    std::nth_element(sample, sample + rank, sample + samples, std::greater<uint64_t>());
    const uint64_t floor = sample[rank];
    int64_t above = 0;
    for (int64_t j = 0; j < n; ++j) {
      picked[above] = x[j];
      above += x[j] >= floor;
    }
    if (above >= k) {
      put_largest_first(picked, above, k, picked + above);
      std::copy(picked, picked + k, x);
      return;
    }
  }
  put_largest_first(x, n, k, scratch);
}

// int8 codes: each slot's logits times its 2^e, from the exponent row after the r channels' rows (an exact product:
// the logits of the float values the codes stand for, summed in the same order)
inline void scale_by_exponents(float* acc, const int8_t* exponents, int64_t n, int64_t group, float* powers) {
  for (int64_t j = 0; j < n; ++j) powers[j] = __builtin_bit_cast(float, (static_cast<int32_t>(exponents[j]) + 127) << 23);
  for (int64_t g = 0; g < group; ++g)
    for (int64_t j = 0; j < n; ++j) acc[g * kSlotBlock + j] *= powers[j];
}

// The KV heads' shares of one budget of rows from their candidates: head h's `counts[h]` values at `candidates +
// h * stride`, distinct within a head. The budget's smallest value is the cut: a head reads its values above it,
// and the cut's own value where it holds it (two heads can hold the same one, the same weight at the same slot:
// the lower heads first), so the shares sum to the budget. Each head's candidates are arranged in place, in one
// pass: the values it reads first, then the others.
std::vector<int64_t> arrange_shares(uint64_t* candidates, int64_t stride, const std::vector<int64_t>& counts,
                                    int64_t budget) {
  const int64_t kv = static_cast<int64_t>(counts.size());
  int64_t total = 0;
  for (int64_t h = 0; h < kv; ++h) total += counts[h];
  uint64_t cut;
  {
    const std::unique_ptr<uint64_t[]> all(new uint64_t[3 * total]);  // every head's candidates, then scratch
    for (int64_t h = 0, at = 0; h < kv; at += counts[h++])
      std::copy(candidates + h * stride, candidates + h * stride + counts[h], &all[at]);
    cut = nth_largest(all.get(), total, budget, all.get() + total);
  }
  std::vector<int64_t> shares(kv);
  std::vector<uint8_t> holds_cut(kv);
  at::parallel_for(0, kv, 1, [&](int64_t begin, int64_t end) {
    for (int64_t h = begin; h < end; ++h) {
      uint64_t* values = candidates + h * stride;
      const int64_t n = counts[h];
      const std::unique_ptr<uint64_t[]> rest(new uint64_t[n]);  // written before read
      int64_t above = 0, below = 0;
      bool holds = false;
      for (int64_t i = 0; i < n; ++i) {
        const uint64_t value = values[i];
        holds |= value == cut;
        values[above] = value;  // i >= above: a value not yet read is never overwritten
        rest[below] = value;
        above += value > cut;
        below += value < cut;
      }
      if (holds) values[above] = cut;
      std::copy(rest.get(), rest.get() + below, values + above + holds);
      shares[h] = above + holds;
      holds_cut[h] = holds;
    }
  });
  int64_t held = 0;
  for (int64_t h = 0; h < kv; ++h) held += shares[h];
  for (int64_t h = kv - 1; h >= 0 && held > budget; --h)
    if (holds_cut[h]) --shares[h], --held;  // its copy of the cut's value, right after the ones it reads: masked
  return shares;
}

// The heads' shares of kv x k rows without each head's best `width` first: a floor from a sample of every head's
// weights (every 16th slot), under which, with a margin, about kv x k values and a few more lie; the values at or
// above it, per head; their shares (arrange_shares). Where no head's share passes `width` (the cap binds for ~2% of
// SmolLM2's heads) these are the shares of the heads' best `width` each too, and each head's row is arranged: its
// share first, then the rest of its values above the floor, then slots left as they were (masked: never read).
// Returns false, with `ranked` as it was, where the sample was too small, the floor let fewer than kv x k values
// pass, or a head passed `width`: the exact way then.
bool shares_from_sample(uint64_t* ranked, int64_t kv, int64_t past, int64_t width, int64_t k,
                        std::vector<int64_t>& counts) {
  constexpr int64_t kMinSample = 64;
  const int64_t per_head = past / kSampleStride, samples = kv * per_head, budget = kv * k;
  if (per_head < kMinSample) return false;
  uint64_t floor;
  {
    const std::unique_ptr<uint64_t[]> sample(new uint64_t[3 * samples]);  // the sample, then scratch
    for (int64_t h = 0; h < kv; ++h)
      for (int64_t i = 0; i < per_head; ++i) sample[h * per_head + i] = ranked[h * past + i * kSampleStride];
    const double expected = static_cast<double>(budget) * per_head / past;  // sampled values among the kv x k
    const int64_t rank = std::min<int64_t>(samples, static_cast<int64_t>(expected + 3.0 * std::sqrt(expected) + 5.0));
    floor = nth_largest(sample.get(), samples, rank, sample.get() + samples);
  }
  // per head, the values at or above the floor (copied out with no branch: which pass is a coin toss)
  const std::unique_ptr<uint64_t[]> picked(new uint64_t[kv * past]);  // head h's from h * past: written before read
  std::vector<int64_t> picked_count(kv);
  at::parallel_for(0, kv, 1, [&](int64_t begin, int64_t end) {
    for (int64_t h = begin; h < end; ++h) {
      const uint64_t* row = ranked + h * past;
      uint64_t* out = &picked[h * past];
      int64_t n = 0;
      for (int64_t j = 0; j < past; ++j) {
        out[n] = row[j];
        n += row[j] >= floor;
      }
      picked_count[h] = n;
    }
  });
  int64_t total = 0;
  for (int64_t h = 0; h < kv; ++h) total += picked_count[h];
  if (total < budget) return false;
  std::vector<int64_t> shares = arrange_shares(picked.get(), past, picked_count, budget);
  for (int64_t h = 0; h < kv; ++h)
    if (shares[h] > width) return false;
  for (int64_t h = 0; h < kv; ++h)
    std::copy(&picked[h * past], &picked[h * past] + std::min(picked_count[h], width), ranked + h * past);
  counts = std::move(shares);
  return true;
}

template <typename Key>
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> rehearse_select_typed(
    const at::Tensor& query, const at::Tensor& partial_keys, int64_t past, int64_t k, double alpha, int64_t width) {
  TORCH_CHECK(partial_keys.stride(2) == 1, "partial keys must be contiguous along slots");
  const at::Tensor q_contig = query.contiguous();
  const int64_t kv = q_contig.size(0), group = q_contig.size(1), r = q_contig.size(2);
  constexpr bool has_exponents = std::is_same_v<Key, int8_t>;
  TORCH_CHECK(partial_keys.size(0) == kv && partial_keys.size(1) == r + (has_exponents ? 1 : 0),
              "query and partial keys disagree");
  TORCH_CHECK(group <= kMaxGroup && 0 < k && k <= past && past <= partial_keys.size(2), "bad sizes");
  TORCH_CHECK(k <= width && width <= past, "a width of ", width, " for ", k, " rows per head over ", past);
  TORCH_CHECK(!has_exponents || r <= kMaxDim, "int8 partial keys of at most ", kMaxDim, " channels");
  const bool spread = width > k;  // the heads' rows drawn from one budget of kv x k: a mask per head

  auto slots = at::empty({kv, width}, q_contig.options().dtype(at::kLong));
  auto scores = at::empty({kv, width}, q_contig.options());
  auto valid = at::empty({spread ? kv : 1, width + 1}, q_contig.options().dtype(at::kBool));
  const float* q_all = q_contig.data_ptr<float>();
  const Key* keys_all = partial_keys.data_ptr<Key>();
  const int64_t head_stride = partial_keys.stride(0), channel_stride = partial_keys.stride(1);
  const float floor_gap = static_cast<float>(alpha);
  const int64_t blocks = (past + kSlotBlock - 1) / kSlotBlock;
  const QueryCodes query_codes = has_exponents ? code_query(q_all, kv * group, r) : QueryCodes{};

  // 1. per (head, block of slots): logits, each channel's row of keys read once for the whole group, and
  //    per query head the block's maximum and its sum of e^(logit - that maximum)
  // every value of these two is written before it is read: left uninitialised (at 8k slots, zeroing them
  // cost more than the pass that writes them)
  const std::unique_ptr<float[]> logits(new float[kv * group * past]);
  std::vector<float> block_peaks(kv * blocks * group), block_sums(kv * blocks * group);
  at::parallel_for(0, kv * blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> acc(kMaxGroup * kSlotBlock), powers(kSlotBlock);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task / blocks, j0 = (task % blocks) * kSlotBlock, n = std::min(kSlotBlock, past - j0);
      const Key* head_keys = keys_all + h * head_stride + j0;
      if constexpr (has_exponents) {  // int8 codes: exact integer sums against the query's codes
        const int64_t done = coded_block_logits(acc.data(), query_codes, h * group, head_keys, channel_stride, n, group);
        if (done < n)
          coded_logits_rows(acc.data(), &query_codes.codes[h * group * r], &query_codes.powers[h * group], head_keys,
                            channel_stride, r, done, n, group);
        scale_by_exponents(acc.data(), head_keys + r * channel_stride, n, group, powers.data());
      } else {
        const float* q = q_all + h * group * r;
        const int64_t done = block_logits(acc.data(), q, head_keys, channel_stride, r, n, group);
        if (done < n) {  // the rest of the block, one channel's row at a time
          for (int64_t g = 0; g < group; ++g) std::fill_n(&acc[g * kSlotBlock + done], n - done, 0.0f);
          for (int64_t c = 0; c < r; ++c) {
            const Key* row = head_keys + c * channel_stride + done;
            for (int64_t g = 0; g < group; ++g) add_scaled(&acc[g * kSlotBlock + done], row, n - done, q[g * r + c]);
          }
        }
      }
      for (int64_t g = 0; g < group; ++g) {
        const float* block = &acc[g * kSlotBlock];
        const float peak = max_of(block, n);
        for (int64_t j = 0; j < n; ++j) powers[j] = exp_nonpositive(block[j] - peak);
        block_peaks[task * group + g] = peak;
        block_sums[task * group + g] = sum_of(powers.data(), n);
        std::memcpy(&logits[(h * group + g) * past + j0], block, sizeof(float) * n);
      }
    }
  });

  // each query head's maximum and softmax denominator, from its blocks'
  std::vector<float> peaks(kv * group, kNegInf), inverse_sums(kv * group);
  for (int64_t h = 0; h < kv; ++h) {
    for (int64_t g = 0; g < group; ++g) {
      float& peak = peaks[h * group + g];
      for (int64_t b = 0; b < blocks; ++b) peak = std::max(peak, block_peaks[(h * blocks + b) * group + g]);
      float total = 0.0f;
      for (int64_t b = 0; b < blocks; ++b) {
        const int64_t t = (h * blocks + b) * group + g;
        total += block_sums[t] * exp_nonpositive(block_peaks[t] - peak);
      }
      inverse_sums[h * group + g] = 1.0f / total;
    }
  }

  // 2. per (head, block): the alpha count, and each slot's weight (its group's softmax weights summed)
  //    packed with the slot as one integer: weights are >= 0, and such floats order like their bits
  //    (the lower slot first among equal weights)
  const std::unique_ptr<uint64_t[]> ranked(new uint64_t[kv * past]);
  std::vector<int64_t> block_counts(kv * blocks, 0);
  at::parallel_for(0, kv * blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> weights(kSlotBlock);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task / blocks, j0 = (task % blocks) * kSlotBlock, n = std::min(kSlotBlock, past - j0);
      std::fill(weights.begin(), weights.begin() + n, 0.0f);
      int64_t above = 0;
      for (int64_t g = 0; g < group; ++g) {
        const float* row = &logits[(h * group + g) * past + j0];
        const float peak = peaks[h * group + g], floor_logit = peak - floor_gap, inverse = inverse_sums[h * group + g];
        above += count_above(row, n, floor_logit);
        for (int64_t j = 0; j < n; ++j) weights[j] += exp_nonpositive(row[j] - peak) * inverse;
      }
      block_counts[task] = above;
      uint64_t* out = &ranked[h * past + j0];
      for (int64_t j = 0; j < n; ++j) {
        const uint32_t slot = static_cast<uint32_t>(j0 + j);
        out[j] = (static_cast<uint64_t>(__builtin_bit_cast(uint32_t, weights[j])) << 32) | static_cast<uint32_t>(~slot);
      }
    }
  });

  // 3. the alpha mask over ranks (the new token is rank -1): rank m is kept while m * heads < the total
  int64_t total = 0;
  for (int64_t t = 0; t < kv * blocks; ++t) total += block_counts[t];
  const int64_t heads = kv * group;
  std::vector<uint8_t> alpha_mask(width + 1);
  int64_t kept = 0;
  for (int64_t m = 0; m <= width; ++m) {
    alpha_mask[m] = (m - 1) * heads < total;
    kept += m > 0 && alpha_mask[m];
  }

  // 4. per head: its top `width` (k where the heads read alike), and 5. how many of them it reads: k each, or where
  //    the heads draw on one budget, its share of the kv x k best of the heads' candidates, read first in its row.
  //    Mostly the shares come from one sample of every head; else from each head's best `width`
  std::vector<int64_t> counts(kv, k);
  if (!spread || !shares_from_sample(ranked.get(), kv, past, width, k, counts)) {
    at::parallel_for(0, kv, 1, [&](int64_t begin, int64_t end) {
      const std::unique_ptr<uint64_t[]> scratch(new uint64_t[largest_first_scratch(past)]);  // written before read
      for (int64_t h = begin; h < end; ++h)
        if (width < past) largest_first(&ranked[h * past], past, width, scratch.get());
    });
    if (spread) counts = arrange_shares(ranked.get(), past, std::vector<int64_t>(kv, width), kv * k);
  }
  // 6. per head: its rows partitioned once more where the alpha mask cuts them, so the rows kept come first
  bool* mask = valid.data_ptr<bool>();
  at::parallel_for(0, kv, 1, [&](int64_t begin, int64_t end) {
    const std::unique_ptr<uint64_t[]> scratch(new uint64_t[2 * width]);  // written before read
    for (int64_t h = begin; h < end; ++h) {
      uint64_t* head = &ranked[h * past];
      const int64_t count = counts[h], used = std::min(kept, count);
      if (0 < used && used < count) put_largest_first(head, count, used, scratch.get());
      if (spread || h == 0)
        for (int64_t m = 0; m <= width; ++m) mask[(spread ? h : 0) * (width + 1) + m] = alpha_mask[m] && m - 1 < count;
      float* score_out = scores.data_ptr<float>() + h * width;
      int64_t* slot_out = slots.data_ptr<int64_t>() + h * width;
      for (int64_t i = 0; i < width; ++i) {
        score_out[i] = __builtin_bit_cast(float, static_cast<uint32_t>(head[i] >> 32));
        slot_out[i] = static_cast<int64_t>(~static_cast<uint32_t>(head[i]));
      }
    }
  });
  return {slots, scores, valid, at::scalar_tensor(total, q_contig.options().dtype(at::kLong))};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> rehearse_select(
    const at::Tensor& query, const at::Tensor& partial_keys, int64_t past, int64_t k, double alpha, int64_t width) {
  TORCH_CHECK(query.dim() == 3 && partial_keys.dim() == 3, "query [kv, group, r] and partial keys [kv, r, slots]");
  TORCH_CHECK(query.scalar_type() == at::kFloat, "a float32 query");
  if (partial_keys.scalar_type() == at::kHalf)
    return rehearse_select_typed<at::Half>(query, partial_keys, past, k, alpha, width);
  if (partial_keys.scalar_type() == at::kChar)
    return rehearse_select_typed<int8_t>(query, partial_keys, past, k, alpha, width);
  TORCH_CHECK(partial_keys.scalar_type() == at::kFloat, "float32, float16 or int8 partial keys");
  return rehearse_select_typed<float>(query, partial_keys, past, k, alpha, width);
}

// ---------------------------------------------------------------------------------------------- attention

constexpr int64_t kPrefetchRows = 8;  // rows are picked by slot: ask for a row's cache lines this far ahead

// Rows of at least this many bytes are read in slot order (below: in the order named). Measured at one thread
// (docs/BENCHMARKS.md): 1 KB rows (Gemma 3 270M, 256 channels) took 0.88-0.92x the time in slot order, 256-byte
// rows (SmolLM2, 64 channels) 1.00-1.09x, the hardware prefetcher fetching the gaps between short rows.
constexpr int64_t kSortedRowBytes = 1024;

// The slots one KV head attends to, masked rows left out; for rows of kSortedRowBytes or more in ascending
// order: read in the order they lie in the pool, consecutive rows share pages (and their translations) and the
// hardware prefetcher follows the stream, where the selection's order jumps about the layer. The order does not
// change what attention computes, only the rounding of its sums. A slot named twice keeps the given order, both
// times (as the rows were given).
void visiting_order(const int64_t* slot, int64_t m, const bool* use, int64_t slot_count, bool sort,
                    std::vector<uint64_t>& seen, int64_t* out) {
  seen.assign(sort ? (slot_count + 63) / 64 : 0, 0);
  bool as_named = !sort;  // short rows, or a slot named twice
  for (int64_t i = 0; i < m && sort; ++i) {
    if (use != nullptr && !use[i]) continue;
    const uint64_t bit = uint64_t{1} << (slot[i] & 63);
    uint64_t& word = seen[slot[i] >> 6];
    as_named |= (word & bit) != 0;
    word |= bit;
  }
  int64_t n = 0;
  if (as_named) {
    for (int64_t i = 0; i < m; ++i)
      if (use == nullptr || use[i]) out[n++] = slot[i];
    return;
  }
  for (int64_t w = 0; w < static_cast<int64_t>(seen.size()); ++w)
    for (uint64_t word = seen[w]; word != 0; word &= word - 1) out[n++] = w * 64 + __builtin_ctzll(word);
}

void check_pool_attention(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values) {
  TORCH_CHECK(query.dim() == 3 && keys.dim() == 3 && values.dim() == 3, "bad ranks");
  TORCH_CHECK(query.scalar_type() == at::kFloat && keys.scalar_type() == at::kFloat &&
              values.scalar_type() == at::kFloat, "float32 query and rows");
  TORCH_CHECK(keys.stride(2) == 1 && keys.strides() == values.strides(), "K/V rows must be contiguous, alike");
  TORCH_CHECK(keys.size(0) == query.size(0) && keys.size(2) == query.size(2) && values.sizes() == keys.sizes(),
              "query and pool disagree");
  TORCH_CHECK(query.size(1) <= kMaxGroup && query.size(2) <= kMaxDim, "bad sizes");
}

// `order` holds each KV head's slots in the order they are read, head h's `used[h]` of them from h * stride
at::Tensor attend_in_order(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values,
                           const std::vector<int64_t>& order, const std::vector<int64_t>& used, int64_t stride,
                           double scale);

// `valid`: [rows] or [1, rows] (the same rows of every head masked), or [kv, rows] (a mask per head)
at::Tensor attend_rows(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values,
                       const at::Tensor& rows, const c10::optional<at::Tensor>& valid, double scale) {
  check_pool_attention(query, keys, values);
  TORCH_CHECK(rows.dim() == 2 && rows.scalar_type() == at::kLong, "int64 slots [kv, rows]");
  const at::Tensor row_contig = rows.contiguous();
  const int64_t kv = query.size(0), dim = query.size(2), m = row_contig.size(1), slot_count = keys.size(1);
  TORCH_CHECK(row_contig.size(0) == kv && m > 0, "rows and pool disagree");
  const bool* use = nullptr;
  int64_t use_stride = 0;  // between one head's mask and the next: 0 where every head has the same
  at::Tensor valid_contig;
  if (valid.has_value()) {
    valid_contig = valid->contiguous();
    const bool per_head = valid_contig.dim() == 2 && valid_contig.size(0) == kv && kv > 1;
    TORCH_CHECK(valid_contig.scalar_type() == at::kBool && valid_contig.numel() == (per_head ? kv * m : m),
                "valid: [rows] or [kv, rows] bool");
    use = valid_contig.data_ptr<bool>();
    use_stride = per_head ? m : 0;
  }
  const int64_t* row_all = row_contig.data_ptr<int64_t>();
  for (int64_t i = 0; i < kv * m; ++i) TORCH_CHECK(0 <= row_all[i] && row_all[i] < slot_count, "slot out of range");
  std::vector<int64_t> used(kv, m);  // rows each head attends to
  for (int64_t h = 0; h < kv && use != nullptr; ++h) {
    used[h] = std::count(use + h * use_stride, use + h * use_stride + m, true);
    TORCH_CHECK(used[h] > 0, "attend_rows: every row of a head is masked");
  }
  std::vector<int64_t> order(kv * m);
  {
    std::vector<uint64_t> seen;
    const bool sort = dim * static_cast<int64_t>(sizeof(float)) >= kSortedRowBytes;
    for (int64_t h = 0; h < kv; ++h)
      visiting_order(row_all + h * m, m, use == nullptr ? nullptr : use + h * use_stride, slot_count, sort, seen,
                     &order[h * m]);
  }
  return attend_in_order(query, keys, values, order, used, m, scale);
}

// Every slot of [first, end), in every KV head: a dense layer's attention (the new token's slot included) with
// the same arithmetic as attend_rows. For one token over a few hundred slots it costs a fraction of SDPA's
// fixed cost per call, and at long contexts it streams the layer as fast.
at::Tensor attend_span(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values, int64_t first,
                       int64_t end, double scale) {
  check_pool_attention(query, keys, values);
  TORCH_CHECK(0 <= first && first < end && end <= keys.size(1), "attend_span: slots [", first, ", ", end, ") outside ",
              keys.size(1));
  const int64_t kv = query.size(0), used = end - first;
  std::vector<int64_t> order(kv * used);
  for (int64_t h = 0; h < kv; ++h)
    for (int64_t i = 0; i < used; ++i) order[h * used + i] = first + i;
  return attend_in_order(query, keys, values, order, std::vector<int64_t>(kv, used), used, scale);
}

// One chunk of rows in one KV head, for its query group: each row's logits (max in `peak`), the chunk's softmax
// numerators' sums per query head (`sums`), and the weighted sum of its values per query head (`acc`, [group, dim]).
// Rows are picked by slot and read where they lie in the pool. While the logits are computed, each row's key and
// value are asked for a few rows ahead (the value into L2, for the pass over the values that follows): with the sums
// held in registers this took SmolLM2's 28 sparse layers at 8k (15% of the rows, 2 threads) from 6.4-6.6 to
// 4.5-4.7 ms per step (scripts/kernel_timing.py, docs/BENCHMARKS.md).
struct RowChunk {
  const float* q;          // [group, dim]
  const int64_t* slot;     // n slots
  int64_t n;
  const float* keys;       // the head's rows: slot * row_stride
  const float* values;
  int64_t row_stride, group, dim;
  float scale;
};

// GCC (12, -O3) deletes a loop whose body is only __builtin_prefetch as code without effect: an asm statement it
// must keep
inline void prefetch_line(const float* p) {
#if defined(__x86_64__)
  asm volatile("prefetcht0 %0" : : "m"(*p));
#else
  __builtin_prefetch(p);
#endif
}
inline void prefetch_line_l2(const float* p) {
#if defined(__x86_64__)
  asm volatile("prefetcht1 %0" : : "m"(*p));
#else
  __builtin_prefetch(p, 0, 2);
#endif
}

inline void prefetch_rows_ahead(const RowChunk& c, int64_t i) {
  if (i + kPrefetchRows >= c.n) return;
  const int64_t ahead = c.slot[i + kPrefetchRows] * c.row_stride;
  for (int64_t j = 0; j < c.dim; j += 16) {
    prefetch_line(c.keys + ahead + j);
    prefetch_line_l2(c.values + ahead + j);
  }
}

// e^(logit - peak) in place, and their sum per query head: a row whose logit is -inf weighs 0, as does every row of
// a chunk whose peak is -inf
inline void softmax_numerators(const RowChunk& c, float (*weights)[kRowChunk], const float* peak, float* sums) {
  for (int64_t g = 0; g < c.group; ++g) {
    const float top = peak[g];
    for (int64_t i = 0; i < c.n; ++i)
      weights[g][i] = top == kNegInf || weights[g][i] == kNegInf ? 0.0f : exp_nonpositive(weights[g][i] - top);
    sums[g] = sum_of(weights[g], c.n);
  }
}

void attend_chunk(const RowChunk& c, float (*weights)[kRowChunk], float* peak, float* sums, float* acc) {
  std::fill(peak, peak + c.group, kNegInf);
  for (int64_t i = 0; i < c.n; ++i) {
    prefetch_rows_ahead(c, i);
    const float* key = c.keys + c.slot[i] * c.row_stride;
    for (int64_t g = 0; g < c.group; ++g) {
      weights[g][i] = dot(c.q + g * c.dim, key, c.dim) * c.scale;
      peak[g] = std::max(peak[g], weights[g][i]);
    }
  }
  softmax_numerators(c, weights, peak, sums);
  std::fill(acc, acc + c.group * c.dim, 0.0f);
  for (int64_t i = 0; i < c.n; ++i) {
    const float* value = c.values + c.slot[i] * c.row_stride;
    for (int64_t g = 0; g < c.group; ++g) {
      const float w = weights[g][i];
      float* out = acc + g * c.dim;
      for (int64_t j = 0; j < c.dim; ++j) out[j] += w * value[j];
    }
  }
}

#if defined(__AVX512F__)
// The same chunk for a group of G heads and a head dimension a multiple of 16 x V, the sums in registers: a key
// row's 16-channel vectors are loaded once for the whole group (its G dot products summed across the lanes at
// the row's end), and the values are summed V vectors (16 x V channels) at a time, the G x V sums held over
// every row of the chunk, where the loop above reads and writes them in memory at every row.
template <int G, int V>
void attend_chunk_in_registers(const RowChunk& c, float (*weights)[kRowChunk], float* peak, float* sums, float* acc) {
  std::fill(peak, peak + G, kNegInf);
  const int64_t vectors = c.dim / 16;
  for (int64_t i = 0; i < c.n; ++i) {
    prefetch_rows_ahead(c, i);
    const float* key = c.keys + c.slot[i] * c.row_stride;
    __m512 dots[G];
    for (int g = 0; g < G; ++g) dots[g] = _mm512_setzero_ps();
    for (int64_t v = 0; v < vectors; ++v) {
      const __m512 k = _mm512_loadu_ps(key + 16 * v);
      for (int g = 0; g < G; ++g) dots[g] = _mm512_fmadd_ps(_mm512_loadu_ps(c.q + g * c.dim + 16 * v), k, dots[g]);
    }
    for (int g = 0; g < G; ++g) {
      weights[g][i] = _mm512_reduce_add_ps(dots[g]) * c.scale;
      peak[g] = std::max(peak[g], weights[g][i]);
    }
  }
  softmax_numerators(c, weights, peak, sums);
  for (int64_t d0 = 0; d0 < c.dim; d0 += 16 * V) {
    __m512 out[G][V];
    for (int g = 0; g < G; ++g)
      for (int b = 0; b < V; ++b) out[g][b] = _mm512_setzero_ps();
    for (int64_t i = 0; i < c.n; ++i) {
      if (i + kPrefetchRows < c.n)
        for (int b = 0; b < V; ++b) prefetch_line(c.values + c.slot[i + kPrefetchRows] * c.row_stride + d0 + 16 * b);
      const float* value = c.values + c.slot[i] * c.row_stride + d0;
      __m512 row[V];
      for (int b = 0; b < V; ++b) row[b] = _mm512_loadu_ps(value + 16 * b);
      for (int g = 0; g < G; ++g) {
        const __m512 w = _mm512_set1_ps(weights[g][i]);
        for (int b = 0; b < V; ++b) out[g][b] = _mm512_fmadd_ps(w, row[b], out[g][b]);
      }
    }
    for (int g = 0; g < G; ++g)
      for (int b = 0; b < V; ++b) _mm512_storeu_ps(acc + g * c.dim + d0 + 16 * b, out[g][b]);
  }
}
#endif

using ChunkKernel = void (*)(const RowChunk&, float (*)[kRowChunk], float*, float*, float*);

// The registers' variant where the shapes have one (at most 16 sums held: G x V <= 16), else the plain loop
ChunkKernel chunk_kernel(int64_t group, int64_t dim) {
#if defined(__AVX512F__)
  if (dim % 64 == 0) {
    switch (group) {
      case 1: return &attend_chunk_in_registers<1, 4>;
      case 2: return &attend_chunk_in_registers<2, 4>;
      case 3: return &attend_chunk_in_registers<3, 4>;
      case 4: return &attend_chunk_in_registers<4, 4>;
      default: break;
    }
  }
  if (dim % 32 == 0) {
    switch (group) {
      case 1: return &attend_chunk_in_registers<1, 2>;
      case 2: return &attend_chunk_in_registers<2, 2>;
      case 3: return &attend_chunk_in_registers<3, 2>;
      case 4: return &attend_chunk_in_registers<4, 2>;
      case 5: return &attend_chunk_in_registers<5, 2>;
      case 6: return &attend_chunk_in_registers<6, 2>;
      case 7: return &attend_chunk_in_registers<7, 2>;
      case 8: return &attend_chunk_in_registers<8, 2>;
      default: break;
    }
  }
#endif
  return &attend_chunk;
}

// One token's attention in each KV head over the `used` slots order[h * used, (h + 1) * used)
at::Tensor attend_in_order(const at::Tensor& query, const at::Tensor& keys, const at::Tensor& values,
                           const std::vector<int64_t>& order, const std::vector<int64_t>& used, int64_t stride,
                           double scale) {
  const at::Tensor q_contig = query.contiguous();
  const int64_t kv = q_contig.size(0), group = q_contig.size(1), dim = q_contig.size(2);
  const int64_t head_stride = keys.stride(0), row_stride = keys.stride(1);
  // as many chunks per head as the head reading most rows needs; another head's last ones stay empty
  const int64_t chunks = (*std::max_element(used.begin(), used.end()) + kRowChunk - 1) / kRowChunk;
  std::vector<float> peaks(kv * chunks * group, kNegInf), sums(kv * chunks * group, 0.0f);
  std::vector<float> partial(kv * chunks * group * dim);
  const float* q_all = q_contig.data_ptr<float>();
  const float* k_all = keys.data_ptr<float>();
  const float* v_all = values.data_ptr<float>();
  const ChunkKernel attend_one = chunk_kernel(group, dim);
  // the chunks that hold rows, so that the threads share the rows read and not the (head, chunk) pairs: where the
  // heads read different counts, a head's chunks past its rows are empty (their peaks stay -inf, left out below)
  std::vector<int64_t> tasks;
  tasks.reserve(kv * chunks);
  for (int64_t h = 0; h < kv; ++h)
    for (int64_t c = 0; c * kRowChunk < used[h]; ++c) tasks.push_back(h * chunks + c);
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t begin, int64_t end) {
    float weights[kMaxGroup][kRowChunk];
    for (int64_t index = begin; index < end; ++index) {
      const int64_t task = tasks[index], h = task / chunks, r0 = (task % chunks) * kRowChunk;
      const RowChunk chunk{q_all + h * group * dim, &order[h * stride + r0], std::min(kRowChunk, used[h] - r0),
                           k_all + h * head_stride, v_all + h * head_stride, row_stride, group, dim,
                           static_cast<float>(scale)};
      attend_one(chunk, weights, &peaks[task * group], &sums[task * group], &partial[task * group * dim]);
    }
  });

  // combine the chunks of each (head, query head): rescale by e^(chunk max - max), divide by the total
  auto out = at::zeros({kv, group, dim}, q_contig.options());
  float* o = out.data_ptr<float>();
  for (int64_t h = 0; h < kv; ++h) {
    for (int64_t g = 0; g < group; ++g) {
      float peak = kNegInf;
      for (int64_t c = 0; c < chunks; ++c) peak = std::max(peak, peaks[(h * chunks + c) * group + g]);
      TORCH_CHECK(peak != kNegInf, "attend_rows: every row of a head is masked");
      float total = 0.0f;
      float* dst = o + (h * group + g) * dim;
      for (int64_t c = 0; c < chunks; ++c) {
        const int64_t t = (h * chunks + c) * group + g;
        if (peaks[t] == kNegInf) continue;
        const float factor = exp_nonpositive(peaks[t] - peak);
        total += sums[t] * factor;
        const float* a = &partial[t * dim];
        for (int64_t j = 0; j < dim; ++j) dst[j] += factor * a[j];
      }
      const float inverse = 1.0f / total;
      for (int64_t j = 0; j < dim; ++j) dst[j] *= inverse;
    }
  }
  return out;
}

// ------------------------------------------------------------------------------------- int8 product

constexpr int64_t kQ8Group = 32;  // input channels per scale

// A decode step reads each weight once from memory (the model does not stay in the caches from one token to
// the next), and the hardware's own prefetcher alone left the products at about half the memory's rate: each
// product asks for the rows kRowsAhead ahead of the one it computes (their codes, scales and minima), which
// arrive while it computes. All 210 int4 products of the default model's step, one pass over 80 MB at two
// threads: 5.3-6.4 -> 4.4-4.5 ms (docs/BENCHMARKS.md).
constexpr int64_t kRowsAhead = 8;

inline void prefetch(const void* start, int64_t bytes) {
  const char* at = static_cast<const char*>(start);
  for (int64_t offset = 0; offset < bytes; offset += 64) __builtin_prefetch(at + offset, 0, 3);
}

// sum over one output row's groups of scale[g] * (codes[g] . x[g]); x and the codes of a row are contiguous
inline float q8_row_dot(const int8_t* codes, const float* scales, const float* x, int64_t groups) {
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes + g * kQ8Group));
    const __m512 low = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_castsi256_si128(raw)));
    const __m512 high = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm256_extracti128_si256(raw, 1)));
    __m512 group = _mm512_mul_ps(low, _mm512_loadu_ps(x + g * kQ8Group));
    group = _mm512_fmadd_ps(high, _mm512_loadu_ps(x + g * kQ8Group + 16), group);
    acc = _mm512_fmadd_ps(_mm512_set1_ps(scales[g]), group, acc);
  }
  return _mm512_reduce_add_ps(acc);
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 acc = _mm256_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m256 group = _mm256_setzero_ps();
    for (int64_t j = 0; j < kQ8Group; j += 8) {
      const __m128i raw = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + g * kQ8Group + j));
      const __m256 wide = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(raw));
      group = _mm256_fmadd_ps(wide, _mm256_loadu_ps(x + g * kQ8Group + j), group);
    }
    acc = _mm256_fmadd_ps(_mm256_set1_ps(scales[g]), group, acc);
  }
  const __m128 half = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  const __m128 pairs = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(pairs, _mm_movehdup_ps(pairs)));
#else
  float total = 0.0f;
  for (int64_t g = 0; g < groups; ++g) {
    float group = 0.0f;
    for (int64_t j = 0; j < kQ8Group; ++j) group += static_cast<float>(codes[g * kQ8Group + j]) * x[g * kQ8Group + j];
    total += scales[g] * group;
  }
  return total;
#endif
}

// The decode products' shared checks: one float32 per group of 32 input channels and output row, and the
// activation row as float32 (whatever dtype it came in), one value per input channel.
void check_group_scales(const at::Tensor& t, int64_t count, const char* what) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == count, what,
              " must be a contiguous float32 [out, in / 32]");
}

at::Tensor float_row(const at::Tensor& row, int64_t in_features, const char* op) {
  TORCH_CHECK(row.numel() == in_features, op, ": the row must hold one value per input channel");
  return row.reshape({in_features}).to(at::kFloat).contiguous();
}

at::Tensor q8_matvec(const at::Tensor& row, const at::Tensor& codes, const at::Tensor& scales) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kChar && codes.is_contiguous(),
              "q8_matvec: codes must be a contiguous int8 [out, in]");
  const int64_t out_features = codes.size(0), in_features = codes.size(1);
  TORCH_CHECK(in_features % kQ8Group == 0, "q8_matvec: input channels must be a multiple of 32");
  const int64_t groups = in_features / kQ8Group;
  check_group_scales(scales, out_features * groups, "q8_matvec: scales");
  const at::Tensor x = float_row(row, in_features, "q8_matvec");
  at::Tensor out = at::empty({1, out_features}, row.options().dtype(at::kFloat));
  const float* xs = x.data_ptr<float>();
  const int8_t* cs = codes.data_ptr<int8_t>();
  const float* ss = scales.data_ptr<float>();
  float* os = out.data_ptr<float>();
  at::parallel_for(0, out_features, 256, [&](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end; ++o) {
      if (o + kRowsAhead < end) {
        prefetch(cs + (o + kRowsAhead) * in_features, in_features);
        prefetch(ss + (o + kRowsAhead) * groups, groups * static_cast<int64_t>(sizeof(float)));
      }
      os[o] = q8_row_dot(cs + o * in_features, ss + o * groups, xs, groups);
    }
  });
  return out;
}

at::Tensor q8_matvec_meta(const at::Tensor& row, const at::Tensor& codes, const at::Tensor& scales) {
  return at::empty({1, codes.size(0)}, row.options().dtype(at::kFloat));
}

// ------------------------------------------------------------------------------------- int4 product

// A weight held as 4-bit codes in groups of 32 input channels, w = code * scale + low per group (GGUF's Q4_1
// layout), two codes a byte: byte j of a group holds code j in its low nibble and code j + 16 in its high one.
// One output row is sum over groups of scale[g] * (codes[g] . x[g]) + low[g] * sum(x[g]); the group sums of x
// are taken once per call. Everything in float32: no rounding of the row (a bf16 row re-rounds each step's
// activations, so two nearly equal rows can decode apart by the bf16 step, not by their difference).
#if defined(__AVX512F__)
// one group's 32 codes (16 bytes) as two float vectors: codes 0-15, codes 16-31
inline void q4_unpack(const uint8_t* bytes, __m512& first, __m512& second) {
  const __m512i raw = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)));
  first = _mm512_cvtepi32_ps(_mm512_and_si512(raw, _mm512_set1_epi32(0x0F)));
  second = _mm512_cvtepi32_ps(_mm512_srli_epi32(raw, 4));
}
#endif

// `rows` consecutive output rows (1 or 2; two share each load of x): out[r] = sum over groups of
// scale[g] * (codes[g] . x[g]) + low[g] * sum(x[g])
inline void q4_rows_dot(const uint8_t* packed, const float* scales, const float* lows, const float* x,
                        const float* x_sums, int64_t groups, int64_t rows, float* out) {
  constexpr int64_t half = kQ8Group / 2;
  const int64_t row_bytes = groups * half;
#if defined(__AVX512F__)
  if (rows == 2) {
    __m512 acc0 = _mm512_setzero_ps(), acc1 = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      const __m512 x0 = _mm512_loadu_ps(x + g * kQ8Group), x1 = _mm512_loadu_ps(x + g * kQ8Group + 16);
      __m512 a, b, c, d;
      q4_unpack(packed + g * half, a, b);
      q4_unpack(packed + row_bytes + g * half, c, d);
      acc0 = _mm512_fmadd_ps(_mm512_set1_ps(scales[g]), _mm512_fmadd_ps(b, x1, _mm512_mul_ps(a, x0)), acc0);
      acc1 = _mm512_fmadd_ps(_mm512_set1_ps(scales[groups + g]), _mm512_fmadd_ps(d, x1, _mm512_mul_ps(c, x0)), acc1);
    }
    out[0] = _mm512_reduce_add_ps(acc0) + dot(lows, x_sums, groups);
    out[1] = _mm512_reduce_add_ps(acc1) + dot(lows + groups, x_sums, groups);
    return;
  }
  __m512 acc = _mm512_setzero_ps();
  for (int64_t g = 0; g < groups; ++g) {
    __m512 a, b;
    q4_unpack(packed + g * half, a, b);
    const __m512 group = _mm512_fmadd_ps(b, _mm512_loadu_ps(x + g * kQ8Group + 16),
                                         _mm512_mul_ps(a, _mm512_loadu_ps(x + g * kQ8Group)));
    acc = _mm512_fmadd_ps(_mm512_set1_ps(scales[g]), group, acc);
  }
  out[0] = _mm512_reduce_add_ps(acc) + dot(lows, x_sums, groups);
#else
  for (int64_t r = 0; r < rows; ++r) {
    const uint8_t* codes = packed + r * row_bytes;
    float total = 0.0f;
    for (int64_t g = 0; g < groups; ++g) {
      float group = 0.0f;
      for (int64_t j = 0; j < half; ++j) {
        const uint8_t byte = codes[g * half + j];
        group += static_cast<float>(byte & 0x0F) * x[g * kQ8Group + j] +
                 static_cast<float>(byte >> 4) * x[g * kQ8Group + half + j];
      }
      total += scales[r * groups + g] * group;
    }
    out[r] = total + dot(lows + r * groups, x_sums, groups);
  }
#endif
}

at::Tensor q4_matvec(const at::Tensor& row, const at::Tensor& packed, const at::Tensor& scales,
                     const at::Tensor& lows) {
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kByte && packed.is_contiguous(),
              "q4_matvec: packed codes must be a contiguous uint8 [out, in / 2]");
  const int64_t out_features = packed.size(0), in_features = packed.size(1) * 2;
  TORCH_CHECK(in_features % kQ8Group == 0, "q4_matvec: input channels must be a multiple of 32");
  const int64_t groups = in_features / kQ8Group;
  check_group_scales(scales, out_features * groups, "q4_matvec: scales");
  check_group_scales(lows, out_features * groups, "q4_matvec: lows");
  const at::Tensor x = float_row(row, in_features, "q4_matvec");
  const float* xs = x.data_ptr<float>();
  std::vector<float> x_sums(groups, 0.0f);
  for (int64_t g = 0; g < groups; ++g) {
    for (int64_t j = 0; j < kQ8Group; ++j) x_sums[g] += xs[g * kQ8Group + j];
  }
  at::Tensor out = at::empty({1, out_features}, row.options().dtype(at::kFloat));
  const uint8_t* ps = packed.data_ptr<uint8_t>();
  const float* ss = scales.data_ptr<float>();
  const float* ls = lows.data_ptr<float>();
  float* os = out.data_ptr<float>();
  at::parallel_for(0, out_features, 256, [&](int64_t begin, int64_t end) {
    const int64_t row_bytes = in_features / 2;
    for (int64_t o = begin; o < end; o += 2) {
      const int64_t rows = std::min<int64_t>(2, end - o);
      if (o + kRowsAhead < end) {
        const int64_t next = o + kRowsAhead, ahead = std::min<int64_t>(2, end - next);
        prefetch(ps + next * row_bytes, ahead * row_bytes);
        prefetch(ss + next * groups, ahead * groups * static_cast<int64_t>(sizeof(float)));
        prefetch(ls + next * groups, ahead * groups * static_cast<int64_t>(sizeof(float)));
      }
      q4_rows_dot(ps + o * row_bytes, ss + o * groups, ls + o * groups, xs, x_sums.data(), groups, rows,
                  os + o);
    }
  });
  return out;
}

at::Tensor q4_matvec_meta(const at::Tensor& row, const at::Tensor& packed, const at::Tensor& scales,
                          const at::Tensor& lows) {
  return at::empty({1, packed.size(0)}, row.options().dtype(at::kFloat));
}

}  // namespace

TORCH_LIBRARY(infinigen_cpu, m) {
  m.def("rehearse_select(Tensor query, Tensor partial_keys, int past, int k, float alpha, int width) -> "
        "(Tensor, Tensor, Tensor, Tensor)");
  m.def("attend_rows(Tensor query, Tensor keys, Tensor values, Tensor rows, Tensor? valid, float scale) -> Tensor");
  m.def("attend_span(Tensor query, Tensor keys, Tensor values, int first, int end, float scale) -> Tensor");
  m.def("q8_matvec(Tensor row, Tensor codes, Tensor scales) -> Tensor");
  m.def("q4_matvec(Tensor row, Tensor packed, Tensor scales, Tensor lows) -> Tensor");
}

TORCH_LIBRARY_IMPL(infinigen_cpu, CPU, m) {
  m.impl("rehearse_select", rehearse_select);
  m.impl("attend_rows", attend_rows);
  m.impl("attend_span", attend_span);
  m.impl("q8_matvec", q8_matvec);
  m.impl("q4_matvec", q4_matvec);
}

// shapes only, so that a compiled decode step can trace the product (attention stays inside the engine's op)
TORCH_LIBRARY_IMPL(infinigen_cpu, Meta, m) {
  m.impl("q8_matvec", q8_matvec_meta);
  m.impl("q4_matvec", q4_matvec_meta);
}
