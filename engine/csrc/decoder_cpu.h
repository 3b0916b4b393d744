// A Llama-family decoder stack run natively, one call per step (decoder_cpu.cpp): the layers'
// packed weights and norms, held once, and the step's forward over them.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace cbserve {

// One linear layer of the stack, either of two kinds:
// - packed, as engine/backends/cpu_linear.py's PackedWeight holds it: panels (linear_cpu.cpp) and/or
//   oneDNN's blocked copy, the output count, and up to how many rows the panels take when both
//   layouts are there;
// - in GGUF blocks (`blocks` defined), as engine/backends/cpu_quant.py's QuantizedLinear holds it: the
//   file's rows of ggml type `qtype` for k inputs, the order its outputs are moved to (or undefined),
//   whether x goes in as int8 blocks, and above how many rows x a dequantized copy runs instead.
// Either way the bias, or undefined.
struct PackedLinear {
  at::Tensor panels, onednn, bias;
  int64_t n = 0, panel_rows = 0;
  at::Tensor blocks, out_order;
  int64_t qtype = 0, k = 0, dense_rows = 0;
  bool int8 = false;
};

struct DecoderLayer {
  // q/k/v: one packed product on the three weights, in that order, or three products (GGUF blocks)
  std::vector<PackedLinear> qkv;
  PackedLinear o, gate, up, down;
  at::Tensor input_norm, post_norm;
  double input_eps = 0.0, post_eps = 0.0;
  int64_t window = 0;  // sliding window of the layer's attention; 0: none
};

class DecoderStack {
 public:
  DecoderStack(int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double scale);
  void add_layer(const DecoderLayer& layer);
  void set_head(at::Tensor norm, double eps, const PackedLinear& lm_head);
  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }
  // hidden [T, E] (the step's embedded tokens), cos/sin [1, T, D] in the model dtype, the paged cache
  // (one key and one value tensor per layer) and the step's attention metadata: the logits of the
  // rows `logits_rows` [R] int64, [R, vocab] in the model dtype
  at::Tensor forward(at::Tensor hidden, at::Tensor cos, at::Tensor sin, const std::vector<at::Tensor>& k_caches,
                     const std::vector<at::Tensor>& v_caches, at::Tensor block_tables, at::Tensor k_lens,
                     at::Tensor q_start, at::Tensor slot_mapping, at::Tensor logits_rows, int64_t cascade_min_seqs) const;

 private:
  int64_t num_heads_, num_kv_heads_, head_dim_;
  double scale_;
  std::vector<DecoderLayer> layers_;
  at::Tensor final_norm_;
  double final_eps_ = 0.0;
  PackedLinear lm_head_;
};

}  // namespace cbserve
