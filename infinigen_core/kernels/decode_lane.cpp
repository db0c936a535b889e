// The decode lane: a one-token step's attention, layer by layer, with no Python between the layers.
//
// The compiled decode step calls `infinigen_cpu::attend_layer` once per layer (the schema of the engine's
// `infinigen::pool_attention`). Where the engine opened a lane for the running step on this thread
// (decode_lane.py: `lane_begin` with the step's pool storage, slot and budgets; `lane_end` after it), the
// layer's work runs here, in the order the Python path (step.py) runs it:
//   1. the new K/V row into its pool slot;
//   2. a selecting layer: its query through its partial skew, `rehearse_select` over the partial key cache,
//      then `attend_rows` over the new slot and the selected ones, read where they lie in the pool;
//      any other layer: `attend_span` over the layer's slots (a sliding layer's last `window`);
//   3. InfiniGen's sparse layers: the new key's partial key into the partial key cache (`project_key`, which
//      the Python path's `write_step_partial_keys` calls too, so both caches hold the same bits); in a dense
//      step (a short chat's: nothing selects) the policy makes it later, when something reads the cache
//      (`project_slots`): read cold after the model's weights, 28 projections cost ~0.2 ms a step;
//   4. what the statistics need, kept until `lane_end` hands it over (no host read: all of it is CPU memory).
// With no lane open (prefill runs eager; other policies), the op calls the engine's Python op instead.
// Beside the lane, the int8 partial-key cache's other writers: `write_step_partial_keys` (a Python-path step),
// `project_slots` (what dense lane steps left out) and `encode_partial_keys` (a prefill's or a restore's batch).
// The same kernels and ATen ops as the Python path, with the same inputs: the logits agree to the bit.

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <memory>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

struct LayerResult {
  // a selecting layer's: [kv, width] int64, [kv, width] float, 0-dim int64, and which of its slots attention read
  // ([1 or kv, width] bool: the alpha mask, and where the heads share a budget each head's count)
  at::Tensor slots, scores, alpha_total, read;
  int64_t select_ns = 0, attend_ns = 0;
  bool ran = false;
};

struct Lane {
  // per layer
  std::vector<at::Tensor> keys, values;  // the pool's storage [kv, capacity, dim] float32
  std::vector<at::Tensor> partial_keys;  // InfiniGen's cache [kv, r, capacity] (undefined: not sparse)
  std::vector<at::Tensor> query_projections;  // [kv, dim, r] float32 (undefined: not sparse)
  std::vector<at::Tensor> key_projections;  // [kv, dim, r] float32 (undefined: not sparse)
  std::vector<int64_t> windows;  // a sliding layer's window, 0 for a global one
  std::vector<int64_t> budgets;  // rows to select, 0 to attend to every slot (a sliding layer: its window)
  std::vector<int64_t> widths;  // slots each head's selection names (> budget: the heads share kv x budget rows)
  int64_t slot = 0;  // the new token's slot in every layer (the pool appends: slot i holds position i)
  double alpha = 0.0;
  bool project_keys = true;  // false: a dense step, whose partial keys the policy makes later (project_slots)
  at::Tensor new_slot_column;  // [kv, 1] int64 holding `slot`
  std::vector<LayerResult> results;
};

// The lane of the step this thread runs, if any: it holds the pool's storage for that step only, so a pool
// that reallocates or gives memory back between steps is never kept alive from here.
thread_local std::unique_ptr<Lane> running;

// dst[h, j] = src[h, j] for two float32 [kv, dim] views of any strides: a row of a few hundred bytes per head,
// where ATen's copy_ costs microseconds of set-up for each of the step's ~90 such copies
void copy_rows(const at::Tensor& dst, const at::Tensor& src) {
  TORCH_CHECK(dst.scalar_type() == at::kFloat && src.scalar_type() == at::kFloat && dst.sizes() == src.sizes() &&
                  dst.dim() == 2, "copy_rows: two float32 [kv, dim] views");
  float* d = dst.data_ptr<float>();
  const float* s = src.data_ptr<float>();
  const int64_t rows = dst.size(0), cols = dst.size(1);
  const int64_t ds0 = dst.stride(0), ds1 = dst.stride(1), ss0 = src.stride(0), ss1 = src.stride(1);
  for (int64_t h = 0; h < rows; ++h)
    for (int64_t j = 0; j < cols; ++j) d[h * ds0 + j * ds1] = s[h * ss0 + j * ss1];
}

// float16's largest finite value: a partial key past it is stored as it, never as an infinity (what the Python
// path's clamp before its cast does; a NaN stays a NaN either way)
constexpr float kHalfMax = 65504.0f;
constexpr int64_t kMaxPartialChannels = 256;

template <typename Stored>
Stored stored_as(float value);

template <>
float stored_as<float>(float value) { return value; }

template <>
c10::Half stored_as<c10::Half>(float value) {
  return c10::Half(value < -kHalfMax ? -kHalfMax : (value > kHalfMax ? kHalfMax : value));  // round to nearest even
}

// int8 codes (policies/partial_codes.py, `encode`, step for step): the slot's channels clamped to 127 * 2^9, the
// smallest exponent e >= -24 that puts its largest magnitude within 127 codes, codes rounded to nearest even
constexpr float kMaxCoded = 127.0f * 512.0f;
constexpr int kMinExponent = -24;

void encode_slot(const float* sums, int64_t r, int8_t* out, int64_t channel_stride) {
  float clamped[kMaxPartialChannels];
  float magnitude = 0.0f;
  for (int64_t j = 0; j < r; ++j) {
    clamped[j] = std::min(std::max(sums[j], -kMaxCoded), kMaxCoded);
    magnitude = std::max(magnitude, std::fabs(clamped[j]));
  }
  int exponent = 0;
  const float mantissa = std::frexp(std::max(magnitude, 0x1p-30f), &exponent);
  exponent = std::max(mantissa <= 127.0f / 128.0f ? exponent - 7 : exponent - 6, kMinExponent);
  // times a power of two: exact, as ldexp is (and no call per channel)
  const float scale = std::ldexp(1.0f, -exponent);
  int8_t codes[kMaxPartialChannels];  // made side by side (vectorised), then written down the slot's column
  for (int64_t j = 0; j < r; ++j) {
    const float code = std::nearbyint(clamped[j] * scale);
    codes[j] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, code)));  // a NaN: -127
  }
  for (int64_t j = 0; j < r; ++j) out[j * channel_stride] = codes[j];
  out[r * channel_stride] = static_cast<int8_t>(exponent);
}

// Where one layer's new partial key goes: the slot's column of the layer's cache [kv, r, capacity] (int8: [kv, r + 1,
// capacity], the exponent last).
struct PartialKeyColumn {
  const at::Tensor& cache;  // [..., kv, r, capacity], slots contiguous
  int64_t offset;  // the element of (head 0, channel 0) in the slot's column
};

template <typename Stored>
void project_key_as(const PartialKeyColumn& column, const float* key, int64_t key_head_stride,
                    const float* projection, int64_t kv, int64_t dim) {
  const at::Tensor& cache = column.cache;
  constexpr bool coded = std::is_same_v<Stored, int8_t>;
  const int64_t r = cache.size(-2) - (coded ? 1 : 0), head_stride = cache.stride(-3), channel_stride = cache.stride(-2);
  Stored* out = cache.data_ptr<Stored>() + column.offset;
  for (int64_t h = 0; h < kv; ++h) {
    const float* head_key = key + h * key_head_stride;
    const float* head_projection = projection + h * dim * r;
    float sums[kMaxPartialChannels] = {};
    // channel after channel, one fused multiply-add per partial channel (vectorised over the r channels)
    for (int64_t c = 0; c < dim; ++c) {
      const float channel = head_key[c];
      const float* __restrict row = head_projection + c * r;
      for (int64_t j = 0; j < r; ++j) sums[j] = std::fma(channel, row[j], sums[j]);
    }
    if constexpr (coded)
      encode_slot(sums, r, out + h * head_stride, channel_stride);
    else
      for (int64_t j = 0; j < r; ++j) out[h * head_stride + j * channel_stride] = stored_as<Stored>(sums[j]);
  }
}

// One new token's partial key: its key (kv rows of `dim` contiguous floats, `key_head_stride` apart) through the
// layer's key projection [kv, dim, r] (contiguous), into `column`, in the cache's dtype. Each partial channel sums
// the key's channels in order, which is not torch.bmm's order (MKL's): the lane and the Python path both call
// this for a decode step's keys, so their caches agree to the bit. Raw pointers, no ATen view per call: a view
// costs about a microsecond, and the lane stores 28 partial keys a step with the default model.
void project_key(const PartialKeyColumn& column, const float* key, int64_t key_head_stride, const float* projection,
                 int64_t kv, int64_t dim) {
  if (column.cache.scalar_type() == at::kChar)
    project_key_as<int8_t>(column, key, key_head_stride, projection, kv, dim);
  else if (column.cache.scalar_type() == at::kHalf)
    project_key_as<c10::Half>(column, key, key_head_stride, projection, kv, dim);
  else
    project_key_as<float>(column, key, key_head_stride, projection, kv, dim);
}

// The partial channels a cache [..., kv, rows, capacity] holds: int8 codes end with their exponents' row.
int64_t partial_channels(const at::Tensor& cache) { return cache.size(-2) - (cache.scalar_type() == at::kChar ? 1 : 0); }

// What project_key reads and writes fits: a float16 or float32 cache [..., kv, r, capacity] or an int8 one
// [..., kv, r + 1, capacity] with contiguous slots, a contiguous float32 projection [..., kv, dim, r] with
// r <= kMaxPartialChannels, `slot` inside the cache.
void check_partial_keys(const at::Tensor& cache, const at::Tensor& projection, int64_t kv, int64_t dim, int64_t slot) {
  TORCH_CHECK(cache.dim() >= 3 && cache.size(-3) == kv && cache.stride(-1) == 1 &&
                  (cache.scalar_type() == at::kHalf || cache.scalar_type() == at::kFloat ||
                   cache.scalar_type() == at::kChar),
              "partial keys: a float16, float32 or int8 cache [kv, r (+1), capacity], slots contiguous");
  TORCH_CHECK(projection.dim() >= 3 && projection.scalar_type() == at::kFloat && projection.is_contiguous() &&
                  projection.size(-3) == kv && projection.size(-2) == dim &&
                  projection.size(-1) == partial_channels(cache) &&
                  projection.size(-1) <= kMaxPartialChannels,
              "partial keys: a contiguous float32 projection [kv, dim, r <= 256] for the cache's r channels");
  TORCH_CHECK(0 <= slot && slot < cache.size(-1), "partial keys: slot ", slot, " outside the cache");
}

// The Python path's form (StepPartialKeys.write in policies/infinigen.py): one decode step's new keys of every
// sparse layer [layers, kv, 1, dim], through their projections [layers * kv, dim, r], into `cache`
// [layers, kv, r, capacity].
void write_step_partial_keys(const at::Tensor& keys, const at::Tensor& projections, const at::Tensor& cache,
                             int64_t slot) {
  TORCH_CHECK(keys.dim() == 4 && keys.size(2) == 1 && keys.scalar_type() == at::kFloat && keys.is_contiguous() &&
                  cache.dim() == 4 && cache.size(0) == keys.size(0) && projections.size(0) == keys.size(0) * keys.size(1),
              "write_step_partial_keys: contiguous float32 keys [layers, kv, 1, dim], projections [layers * kv, dim, "
              "r], cache [layers, kv, r, capacity]");
  const int64_t kv = keys.size(1), dim = keys.size(3);
  check_partial_keys(cache, projections.view({keys.size(0), kv, dim, -1}), kv, dim, slot);
  const float* key = keys.data_ptr<float>();
  const float* projection = projections.data_ptr<float>();
  for (int64_t layer = 0; layer < keys.size(0); ++layer)
    project_key({cache, layer * cache.stride(0) + slot}, key + layer * kv * dim, dim,
                projection + layer * kv * dim * projections.size(2), kv, dim);
}

// Partial keys a decode lane left out (`lane_begin`'s project_keys: a dense step, whose layers select nothing),
// made when something is about to read the cache: slots [first, end) of every sparse layer, from the pool's keys
// of that layer ([kv, >= end, dim] float32, rows contiguous) through its projection ([layers * kv, dim, r]), into
// `cache` [layers, kv, r, capacity]. The lane copies a step's new key into the pool before it would have
// projected it, and nothing writes those rows since (InfiniGenPolicy makes them first): the same inputs to the
// same function, so the same bits as projecting at each step.
void project_slots(const std::vector<at::Tensor>& keys, const at::Tensor& projections, const at::Tensor& cache,
                   int64_t first, int64_t end) {
  const int64_t layers = static_cast<int64_t>(keys.size());
  TORCH_CHECK(layers > 0 && cache.dim() == 4 && cache.size(0) == layers && projections.dim() == 3 &&
                  projections.size(0) == layers * cache.size(1) && 0 <= first && first <= end,
              "project_slots: a pool key view per sparse layer, projections [layers * kv, dim, r], "
              "cache [layers, kv, r, capacity]");
  const int64_t kv = cache.size(1), dim = projections.size(1), r = projections.size(2);
  if (first == end) return;
  check_partial_keys(cache, projections.view({layers, kv, dim, r}), kv, dim, end - 1);
  const float* projection = projections.data_ptr<float>();
  for (int64_t layer = 0; layer < layers; ++layer) {
    const at::Tensor& layer_keys = keys[layer];
    TORCH_CHECK(layer_keys.dim() == 3 && layer_keys.scalar_type() == at::kFloat && layer_keys.size(0) == kv &&
                    layer_keys.size(1) >= end && layer_keys.size(2) == dim && layer_keys.stride(2) == 1,
                "project_slots: a float32 key view [kv, >= end, dim] per sparse layer");
    const float* key = layer_keys.data_ptr<float>();
    for (int64_t slot = first; slot < end; ++slot)
      project_key({cache, layer * cache.stride(0) + slot}, key + slot * layer_keys.stride(1), layer_keys.stride(0),
                  projection + layer * kv * dim * r, kv, dim);
  }
}

// Partial keys made in a batch (a prefill's, a restore's) into an int8 cache: `partial` [kv, n, r] float32 (channels
// contiguous), the slot of each of its n rows, `cache` [kv, r + 1, capacity] int8 (slots contiguous). Each row is
// coded by encode_slot, so the codes are partial_codes.encode's to the bit, written where they lie: no [kv, n, r + 1]
// temporary, no transpose and no index copy (a 32k-token restore of Gemma 3, 256 channels in 3 layers: 0.15 s in
// those eager passes, 0.09 s here; docs/BENCHMARKS.md, "Resume at 32k on a quiet machine").
void encode_partial_keys(const at::Tensor& partial, const at::Tensor& cache, const at::Tensor& slots) {
  TORCH_CHECK(partial.dim() == 3 && partial.scalar_type() == at::kFloat && partial.stride(2) == 1,
              "encode_partial_keys: float32 partial keys [kv, n, r], channels contiguous");
  const int64_t kv = partial.size(0), n = partial.size(1), r = partial.size(2);
  TORCH_CHECK(cache.dim() == 3 && cache.scalar_type() == at::kChar && cache.size(0) == kv && cache.size(1) == r + 1 &&
                  cache.stride(2) == 1 && r <= kMaxPartialChannels,
              "encode_partial_keys: an int8 cache [kv, r + 1, capacity] (slots contiguous, r <= 256)");
  TORCH_CHECK(slots.dim() == 1 && slots.scalar_type() == at::kLong && slots.size(0) == n,
              "encode_partial_keys: an int64 slot for each row");
  const at::Tensor slot_contig = slots.contiguous();
  const int64_t* slot = slot_contig.data_ptr<int64_t>();
  const int64_t capacity = cache.size(2);
  for (int64_t i = 0; i < n; ++i)
    TORCH_CHECK(0 <= slot[i] && slot[i] < capacity, "encode_partial_keys: slot ", slot[i], " outside the cache");
  const float* rows = partial.data_ptr<float>();
  int8_t* out = cache.data_ptr<int8_t>();
  const int64_t row_head = partial.stride(0), row_stride = partial.stride(1);
  const int64_t head_stride = cache.stride(0), channel_stride = cache.stride(1);
  // consecutive rows of a head to a thread: each writes its own run of slots (bytes of the same cache lines)
  at::parallel_for(0, kv * n, 1024, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t h = task / n, i = task % n;
      encode_slot(rows + h * row_head + i * row_stride, r, out + h * head_stride + slot[i], channel_stride);
    }
  });
}

int64_t elapsed_ns(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - since).count();
}

void lane_begin(std::vector<at::Tensor> keys, std::vector<at::Tensor> values,
                std::vector<std::optional<at::Tensor>> partial_keys,
                std::vector<std::optional<at::Tensor>> query_projections,
                std::vector<std::optional<at::Tensor>> key_projections, std::vector<int64_t> windows, int64_t slot,
                std::vector<int64_t> budgets, std::vector<int64_t> widths, double alpha, bool project_keys) {
  const size_t layers = keys.size();
  TORCH_CHECK(layers > 0 && values.size() == layers && partial_keys.size() == layers &&
                  query_projections.size() == layers && key_projections.size() == layers && windows.size() == layers &&
                  budgets.size() == layers && widths.size() == layers,
              "lane_begin: one entry per layer in every list");
  auto lane = std::make_unique<Lane>();
  const int64_t kv = keys[0].size(0);
  for (size_t layer = 0; layer < layers; ++layer) {
    TORCH_CHECK(keys[layer].dim() == 3 && keys[layer].scalar_type() == at::kFloat && keys[layer].is_contiguous() &&
                    values[layer].sizes() == keys[layer].sizes() && values[layer].is_contiguous(),
                "lane_begin: contiguous float32 K/V storage [kv, capacity, dim]");
    TORCH_CHECK(0 <= slot && slot < keys[layer].size(1), "lane_begin: slot ", slot, " outside the pool");
    const bool is_sparse = partial_keys[layer].has_value();
    TORCH_CHECK(is_sparse == query_projections[layer].has_value() && is_sparse == key_projections[layer].has_value(),
                "lane_begin: partial keys need their query and key projections");
    if (is_sparse) check_partial_keys(*partial_keys[layer], *key_projections[layer], kv, keys[layer].size(2), slot);
    TORCH_CHECK(budgets[layer] == 0 || (is_sparse && budgets[layer] <= widths[layer] && widths[layer] <= slot),
                "lane_begin: layer ", layer, " cannot select ", budgets[layer], " (", widths[layer], " wide) of ", slot,
                " past rows");
    lane->keys.push_back(std::move(keys[layer]));
    lane->values.push_back(std::move(values[layer]));
    lane->partial_keys.push_back(is_sparse ? *partial_keys[layer] : at::Tensor());
    lane->query_projections.push_back(is_sparse ? *query_projections[layer] : at::Tensor());
    lane->key_projections.push_back(is_sparse ? *key_projections[layer] : at::Tensor());
  }
  lane->windows = std::move(windows);
  lane->budgets = std::move(budgets);
  lane->widths = std::move(widths);
  lane->slot = slot;
  lane->alpha = alpha;
  lane->project_keys = project_keys;
  lane->new_slot_column = at::full({kv, 1}, slot, at::TensorOptions().dtype(at::kLong));
  lane->results.resize(layers);
  running = std::move(lane);
}

// What the step's selecting layers left: (slots, scores, alpha totals) of each in layer order, per layer the
// nanoseconds spent selecting and attending [layers, 2] (0 for a layer the lane did not run), and the selecting
// layers' masks of the slots read. Closes the lane of this thread.
std::tuple<std::vector<at::Tensor>, std::vector<at::Tensor>, std::vector<at::Tensor>, at::Tensor,
           std::vector<at::Tensor>> lane_end() {
  std::unique_ptr<Lane> lane = std::move(running);
  std::vector<at::Tensor> slots, scores, totals, read;
  if (!lane) return {slots, scores, totals, at::zeros({0, 2}, at::TensorOptions().dtype(at::kLong)), read};
  at::Tensor times = at::empty({static_cast<int64_t>(lane->results.size()), 2}, at::TensorOptions().dtype(at::kLong));
  int64_t* t = times.data_ptr<int64_t>();
  for (const auto& result : lane->results) {
    // a layer that never attended left its partial key unwritten and its selection missing
    TORCH_CHECK(result.ran, "the decode lane's step ran the attention of only some layers");
    if (result.slots.defined()) {
      slots.push_back(result.slots);
      scores.push_back(result.scores);
      totals.push_back(result.alpha_total);
      read.push_back(result.read);
    }
    *t++ = result.select_ns;
    *t++ = result.attend_ns;
  }
  return {slots, scores, totals, times, read};
}

// A step that failed: the lane closes with nothing handed over.
void lane_abort() { running.reset(); }

using PoolAttention = at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                 const std::optional<at::Tensor>&, const std::optional<at::Tensor>&,
                                 const std::optional<at::Tensor>&, int64_t, double);

at::Tensor attend_in_python(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                            const std::optional<at::Tensor>& layer_input, const std::optional<at::Tensor>& cos,
                            const std::optional<at::Tensor>& sin, int64_t layer, double scaling) {
  static auto op = c10::Dispatcher::singleton().findSchemaOrThrow("infinigen::pool_attention", "").typed<PoolAttention>();
  return op.call(query, key, value, layer_input, cos, sin, layer, scaling);
}

at::Tensor attend_layer(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                        const std::optional<at::Tensor>& layer_input, const std::optional<at::Tensor>& cos,
                        const std::optional<at::Tensor>& sin, int64_t layer, double scaling) {
  Lane* lane = running.get();
  if (lane == nullptr || query.size(2) != 1) return attend_in_python(query, key, value, layer_input, cos, sin, layer, scaling);
  TORCH_CHECK(0 <= layer && layer < static_cast<int64_t>(lane->keys.size()), "attend_layer: no layer ", layer);
  static auto rehearse_select = c10::Dispatcher::singleton()
      .findSchemaOrThrow("infinigen_cpu::rehearse_select", "")
      .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&, const at::Tensor&, int64_t,
                                                                       int64_t, double, int64_t)>();
  static auto attend_rows = c10::Dispatcher::singleton()
      .findSchemaOrThrow("infinigen_cpu::attend_rows", "")
      .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, const at::Tensor&,
                        const std::optional<at::Tensor>&, double)>();
  static auto attend_span = c10::Dispatcher::singleton()
      .findSchemaOrThrow("infinigen_cpu::attend_span", "")
      .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&, int64_t, int64_t, double)>();
  const auto started = std::chrono::steady_clock::now();
  const at::Tensor& keys = lane->keys[layer];
  const at::Tensor& values = lane->values[layer];
  const int64_t kv = keys.size(0), dim = keys.size(2), slot = lane->slot, size = slot + 1;
  TORCH_CHECK(key.size(1) == kv && key.size(3) == dim && query.size(3) == dim, "attend_layer: the step's shapes are not the lane's");
  // 1. the new row into its slot ([1, kv, 1, dim] -> [kv, dim])
  const at::Tensor new_key = key.select(0, 0).select(1, 0), new_value = value.select(0, 0).select(1, 0);
  copy_rows(keys.select(1, slot), new_key);
  copy_rows(values.select(1, slot), new_value);
  const at::Tensor grouped = query.reshape({kv, -1, dim});  // [kv, group, dim]: each KV head's query group
  LayerResult& result = lane->results[layer];
  result.ran = true;
  at::Tensor out;
  const int64_t budget = lane->budgets[layer];
  if (budget > 0) {
    // 2a. select: the query through the layer's partial skew (scale folded in), then the kernels
    const at::Tensor partial_query = at::bmm(grouped, lane->query_projections[layer]);
    auto [slots, scores, valid, alpha_total] =
        rehearse_select.call(partial_query, lane->partial_keys[layer], slot, budget, lane->alpha, lane->widths[layer]);
    const auto selected = std::chrono::steady_clock::now();
    result.select_ns = elapsed_ns(started);
    const at::Tensor rows = at::cat({lane->new_slot_column, slots}, 1);
    const at::Tensor live_keys = keys.slice(1, 0, size), live_values = values.slice(1, 0, size);
    out = attend_rows.call(grouped, live_keys, live_values, rows, valid, scaling);  // valid: [1 or kv, rows]
    result.slots = slots;
    result.scores = scores;
    result.alpha_total = alpha_total;
    result.read = valid.slice(1, 1);  // the slots', after the new token's column
    result.attend_ns = elapsed_ns(selected);
  } else {
    // 2b. every slot (a sliding layer: its last `window`), as the Python path reads them
    const int64_t window = lane->windows[layer];
    const int64_t first = window > 0 ? std::max<int64_t>(0, size - window) : 0;
    out = attend_span.call(grouped, keys, values, first, size, scaling);
    result.attend_ns = elapsed_ns(started);
  }
  // 3. the new token's partial key, unless the policy makes it later (a dense step). A selection above read only
  // the slots before this one; a step that fails after this leaves a partial key in a slot the pool gives again,
  // written again by the step that takes it
  if (lane->project_keys && lane->partial_keys[layer].defined())
    project_key({lane->partial_keys[layer], slot}, keys.data_ptr<float>() + slot * dim, keys.stride(0),
                lane->key_projections[layer].data_ptr<float>(), kv, dim);
  return out.view({1, 1, -1, dim});
}

at::Tensor attend_layer_meta(const at::Tensor& query, const at::Tensor& key, const at::Tensor& value,
                             const std::optional<at::Tensor>& layer_input, const std::optional<at::Tensor>& cos,
                             const std::optional<at::Tensor>& sin, int64_t layer, double scaling) {
  return at::empty({query.size(0), query.size(2), query.size(1), query.size(3)}, query.options());
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(infinigen_cpu, m) {
  m.def("attend_layer(Tensor query, Tensor key, Tensor value, Tensor? layer_input, Tensor? cos, Tensor? sin, "
        "int layer, float scaling) -> Tensor");
  // the lane's opening and closing: plain functions of the engine's, not tensor ops (one kernel for all keys)
  m.def("lane_begin(Tensor[] keys, Tensor[] values, Tensor?[] partial_keys, Tensor?[] query_projections, "
        "Tensor?[] key_projections, int[] windows, int slot, int[] budgets, int[] widths, float alpha, "
        "bool project_keys) -> ()",
        &lane_begin);
  m.def("lane_end() -> (Tensor[], Tensor[], Tensor[], Tensor, Tensor[])", &lane_end);
  m.def("lane_abort() -> ()", &lane_abort);
  m.def("write_step_partial_keys(Tensor keys, Tensor projections, Tensor(a!) cache, int slot) -> ()");
  m.def("project_slots(Tensor[] keys, Tensor projections, Tensor(a!) cache, int first, int end) -> ()");
  m.def("encode_partial_keys(Tensor partial, Tensor(a!) cache, Tensor slots) -> ()");
}

TORCH_LIBRARY_IMPL(infinigen_cpu, CPU, m) {
  m.impl("attend_layer", attend_layer);
  m.impl("write_step_partial_keys", write_step_partial_keys);
  m.impl("project_slots", project_slots);
  m.impl("encode_partial_keys", encode_partial_keys);
}

TORCH_LIBRARY_IMPL(infinigen_cpu, Meta, m) {
  m.impl("attend_layer", attend_layer_meta);
}
