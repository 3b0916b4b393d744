// A Llama-family decoder stack in one native call per step: for each layer RMSNorm, the q/k/v
// product, rotary, the new keys and values into the paged cache, paged attention, o_proj and the
// residual, RMSNorm, gate/up, SiLU-mul, down and the residual; then the final norm and the LM head
// on the rows that sample. Each stage is the very kernel the Python path calls (linear_cpu.cpp's
// panels or oneDNN's packed product, elementwise_cpu.cpp's passes, paged_attention_cpu.cpp), in the
// same order on the same shapes, so the logits are the Python path's bit for bit; what goes is the
// Python and the torch dispatch between them (engine/backends/cpu_layers.py decides which models and
// steps come here).
#include "decoder_cpu.h"

#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <ATen/ops/add.h>
#include <ATen/ops/cat.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/linear.h>

#include "int8_lanes.h"
#include "vec.h"

#include <cstring>
#include <string>

at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps);
at::Tensor silu_mul(at::Tensor gate, at::Tensor up);
at::Tensor rotary(at::Tensor x, at::Tensor cos, at::Tensor sin);
at::Tensor packed_linear(at::Tensor x, at::Tensor panels, c10::optional<at::Tensor> bias, int64_t n);
at::Tensor quant_linear(at::Tensor x, at::Tensor w, int64_t qtype, c10::optional<at::Tensor> bias, bool int8);
at::Tensor quant_dequantize(at::Tensor w, int64_t qtype, int64_t k, c10::optional<at::Tensor> rows, at::Tensor like);
at::Tensor kquant_linear(at::Tensor x, at::Tensor w, int64_t qtype, c10::optional<at::Tensor> bias, bool int8);
at::Tensor kquant_dequantize(at::Tensor w, int64_t qtype, int64_t k, c10::optional<at::Tensor> rows, at::Tensor like);
void paged_attention(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_tables,
                     at::Tensor k_lens, at::Tensor q_start, double scale, int64_t window, int64_t cascade_min_seqs);

namespace cbserve {
namespace {

constexpr int64_t kQ4_K = 12, kQ6_K = 14;  // ggml's K-quant type numbers (kquant_cpu.cpp's)

// x [M, K] times a weight in GGUF blocks, as cpu_quant.py's QuantizedLinear.forward takes it: the
// block product (int8 inputs, or up to dense_rows rows), its outputs moved to out_order and the bias
// added after; or the weight dequantized (rows in order) for torch's product
at::Tensor block_linear(const PackedLinear& l, const at::Tensor& x) {
  const c10::optional<at::Tensor> bias = l.bias.defined() ? c10::optional<at::Tensor>(l.bias) : c10::nullopt;
  const c10::optional<at::Tensor> order = l.out_order.defined() ? c10::optional<at::Tensor>(l.out_order) : c10::nullopt;
  const int64_t base = l.qtype & ~kRepacked;
  const bool kquant = base == kQ4_K || base == kQ6_K;
  if (x.size(0) <= l.dense_rows || l.int8) {
    const auto product = [&](const c10::optional<at::Tensor>& b) {
      return kquant ? kquant_linear(x, l.blocks, l.qtype, b, l.int8) : quant_linear(x, l.blocks, l.qtype, b, l.int8);
    };
    if (!order) return product(bias);
    const at::Tensor y = product(c10::nullopt).index_select(1, *order);
    return bias ? at::add(y, *bias) : y;
  }
  const at::Tensor w = kquant ? kquant_dequantize(l.blocks, l.qtype, l.k, order, x) : quant_dequantize(l.blocks, l.qtype, l.k, order, x);
  return at::linear(x, w, bias);
}

// x [M, K] times a packed weight, as cpu_linear.py's _packed_linear: the panels for up to
// panel_rows rows (or always without oneDNN's copy), oneDNN's packed product otherwise (in float32
// when its copy is float32 and x is not, rounded back); or block_linear's product
at::Tensor linear(const PackedLinear& l, const at::Tensor& x) {
  if (l.blocks.defined()) return block_linear(l, x);
  const c10::optional<at::Tensor> bias = l.bias.defined() ? c10::optional<at::Tensor>(l.bias) : c10::nullopt;
  if (l.panels.defined() && (!l.onednn.defined() || x.size(0) <= l.panel_rows)) return packed_linear(x, l.panels, bias, l.n);
  static const c10::OperatorHandle op = c10::Dispatcher::singleton().findSchemaOrThrow("mkldnn::_linear_pointwise", "");
  const auto dtype = x.scalar_type();
  const bool widen = l.onednn.scalar_type() != dtype;
  torch::jit::Stack stack;
  stack.emplace_back(widen ? x.to(at::kFloat) : x);
  stack.emplace_back(l.onednn);
  stack.emplace_back(bias ? c10::IValue(widen ? bias->to(at::kFloat) : *bias) : c10::IValue());
  stack.emplace_back(std::string("none"));
  stack.emplace_back(c10::List<c10::optional<at::Scalar>>());
  stack.emplace_back(c10::optional<std::string>(std::string()));
  op.callBoxed(&stack);
  at::Tensor y = stack[0].toTensor();
  return widen ? y.to(dtype) : y;
}

// a + b in the model dtype, as torch's add rounds it (a float32 sum, rounded once)
template <typename T>
void add_rows(const T* a, const T* b, T* out, int64_t n) {
  at::parallel_for(0, n, 32768, [&](int64_t begin, int64_t end) {
    int64_t i = begin;
    for (; i + kLanes <= end; i += kLanes) store(out + i, load(a + i) + load(b + i));
    for (; i < end; ++i) out[i] = static_cast<T>(static_cast<float>(a[i]) + static_cast<float>(b[i]));
  });
}

at::Tensor add_residual(const at::Tensor& a, const at::Tensor& b) {
  at::Tensor out = at::empty_like(a);
  for_each_float_type(a, "decoder_stack", [&](auto zero) {
    using T = decltype(zero);
    add_rows(a.data_ptr<T>(), b.data_ptr<T>(), out.data_ptr<T>(), a.numel());
  });
  return out;
}

// rows of `src` ([T] rows of `width` elements, `stride` apart) into the cache's flat slots
void write_rows(at::Tensor& cache, const at::Tensor& src, int64_t stride, int64_t width, const int64_t* slots,
                int64_t tokens) {
  const int64_t num_slots = cache.size(0) * cache.size(1);
  const int64_t bytes = width * cache.element_size();
  const char* from = static_cast<const char*>(src.data_ptr());
  char* to = static_cast<char*>(cache.data_ptr());
  for (int64_t t = 0; t < tokens; ++t) {
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "decoder_stack: slot outside the cache");
    std::memcpy(to + slots[t] * bytes, from + t * stride * cache.element_size(), bytes);
  }
}

}  // namespace

DecoderStack::DecoderStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double scale)
    : num_heads_(num_heads), num_kv_heads_(num_kv_heads), head_dim_(head_dim), scale_(scale) {
  TORCH_CHECK(num_heads > 0 && num_kv_heads > 0 && num_heads % num_kv_heads == 0 && head_dim > 0 && head_dim % 2 == 0,
              "DecoderStack: heads must be a multiple of the KV heads, head_dim even");
}

void DecoderStack::add_layer(const DecoderLayer& layer) {
  const auto& qkv = layer.qkv;
  const int64_t q = num_heads_ * head_dim_, kv = num_kv_heads_ * head_dim_;
  TORCH_CHECK((qkv.size() == 1 && qkv[0].n == q + 2 * kv) ||
                  (qkv.size() == 3 && qkv[0].n == q && qkv[1].n == kv && qkv[2].n == kv),
              "DecoderStack: the q/k/v products must give every head's query, key and value");
  layers_.push_back(layer);
}

void DecoderStack::set_head(at::Tensor norm, double eps, const PackedLinear& lm_head) {
  final_norm_ = norm;
  final_eps_ = eps;
  lm_head_ = lm_head;
}

at::Tensor DecoderStack::forward(at::Tensor hidden, at::Tensor cos, at::Tensor sin, const std::vector<at::Tensor>& k_caches,
                                 const std::vector<at::Tensor>& v_caches, at::Tensor block_tables, at::Tensor k_lens,
                                 at::Tensor q_start, at::Tensor slot_mapping, at::Tensor logits_rows,
                                 int64_t cascade_min_seqs) const {
  const int64_t layers = num_layers();
  TORCH_CHECK(final_norm_.defined(), "DecoderStack: no final norm and LM head set");
  TORCH_CHECK(static_cast<int64_t>(k_caches.size()) == layers && static_cast<int64_t>(v_caches.size()) == layers,
              "DecoderStack: one key and one value cache per layer expected");
  TORCH_CHECK(hidden.dim() == 2 && hidden.is_contiguous() && hidden.device().is_cpu(),
              "DecoderStack: hidden must be a contiguous CPU [tokens, hidden] tensor");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.numel() == hidden.size(0),
              "DecoderStack: one int64 slot per token expected");
  const int64_t T = hidden.size(0), H = num_heads_, Hkv = num_kv_heads_, D = head_dim_;
  const int64_t wq = H * D, wkv = Hkv * D, width = wq + 2 * wkv;
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  at::Tensor h = hidden;
  for (int64_t i = 0; i < layers; ++i) {
    const DecoderLayer& l = layers_[i];
    at::Tensor k_cache = k_caches[i], v_cache = v_caches[i];
    TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous() && k_cache.dim() == 4 &&
                    k_cache.size(2) == Hkv && k_cache.size(3) == D && v_cache.sizes() == k_cache.sizes() &&
                    k_cache.scalar_type() == h.scalar_type() && v_cache.scalar_type() == h.scalar_type(),
                "DecoderStack: the caches do not match the layer");
    // attention: the three projections are views of one product, as cpu_linear.py's group gives them
    // (three products apart, GGUF blocks: side by side in one tensor, the same values)
    const at::Tensor normed = rms_norm(h, l.input_norm, l.input_eps);
    const at::Tensor qkv = l.qkv.size() == 1 ? linear(l.qkv[0], normed)
                                             : at::cat({linear(l.qkv[0], normed), linear(l.qkv[1], normed), linear(l.qkv[2], normed)}, 1);
    const at::Tensor q = rotary(qkv.narrow(1, 0, wq).view({1, T, H, D}).transpose(1, 2), cos, sin);
    const at::Tensor k = rotary(qkv.narrow(1, wq, wkv).view({1, T, Hkv, D}).transpose(1, 2), cos, sin);
    // rotary's outputs are laid out [1, T, heads, D]; values are rows of the product
    write_rows(k_cache, k, wkv, wkv, slots, T);
    write_rows(v_cache, qkv.narrow(1, wq + wkv, wkv), width, wkv, slots, T);
    at::Tensor attn = at::empty({T, H, D}, h.options());
    paged_attention(attn, q.select(0, 0).transpose(0, 1), k_cache, v_cache, block_tables, k_lens, q_start, scale_,
                    l.window, cascade_min_seqs);
    h = add_residual(h, linear(l.o, attn.view({T, wq})));
    // MLP
    const at::Tensor x = rms_norm(h, l.post_norm, l.post_eps);
    const at::Tensor gated = silu_mul(linear(l.gate, x), linear(l.up, x));
    h = add_residual(h, linear(l.down, gated));
  }
  const at::Tensor last = rms_norm(h.index_select(0, logits_rows), final_norm_, final_eps_);
  return linear(lm_head_, last);
}

}  // namespace cbserve
