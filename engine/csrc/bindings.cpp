// The Python module of cbserve's CPU kernels: one binding per kernel file.
#include <torch/csrc/utils/pybind.h>
#include <pybind11/stl.h>

#include "decoder_cpu.h"
#include "vec.h"
#include "version_watch.h"

void paged_attention(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_tables,
                     at::Tensor k_lens, at::Tensor q_start, double scale, int64_t window, int64_t cascade_min_seqs);
at::Tensor argmax_rows(at::Tensor logits);
at::Tensor rms_norm(at::Tensor x, at::Tensor weight, double eps);
at::Tensor silu_mul(at::Tensor gate, at::Tensor up);
at::Tensor rotary(at::Tensor x, at::Tensor cos, at::Tensor sin);
at::Tensor pack_linear_weight(at::Tensor weight);
at::Tensor packed_linear(at::Tensor x, at::Tensor panels, c10::optional<at::Tensor> bias, int64_t n);
int64_t linear_panel_width();
at::Tensor quant_linear(at::Tensor x, at::Tensor w, int64_t qtype, c10::optional<at::Tensor> bias, bool int8);
at::Tensor quant_dequantize(at::Tensor w, int64_t qtype, int64_t k, c10::optional<at::Tensor> rows, at::Tensor like);
bool quant_vnni_available();
int64_t quant_repack_rows();
at::Tensor quant_repack(at::Tensor w, int64_t qtype, int64_t k);
at::Tensor kquant_linear(at::Tensor x, at::Tensor w, int64_t qtype, c10::optional<at::Tensor> bias, bool int8);
at::Tensor kquant_dequantize(at::Tensor w, int64_t qtype, int64_t k, c10::optional<at::Tensor> rows, at::Tensor like);
bool set_quant_vnni(bool on);
at::Tensor sample_race(at::Tensor logits, at::Tensor temperature, at::Tensor top_p, at::Tensor min_p, at::Tensor keys,
                       at::Tensor counters);
at::Tensor race_uniforms(int64_t key, int64_t counter, int64_t n);
at::Tensor logsumexp_rows(at::Tensor logits);

// Every kernel runs with the GIL released, as torch's own ops do: while the engine thread computes
// a step, the server's event loop and other threads run Python.
using NoGil = py::call_guard<py::gil_scoped_release>;

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // cascade_min_seqs defaults to engine/backends/cpu.py's CASCADE_MIN_SEQS, which the engine passes
  m.def("paged_attention", &paged_attention, "Attention over the paged KV cache for a whole step (CPU)", py::arg("out"),
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_tables"), py::arg("k_lens"),
        py::arg("q_start"), py::arg("scale"), py::arg("window"), py::arg("cascade_min_seqs") = 4, NoGil());
  m.def("argmax_rows", &argmax_rows, "Index of each row's largest value, in the tensor's own dtype (CPU)", NoGil());
  m.def("rms_norm", &rms_norm, "transformers' RMSNorm in one pass over each row (CPU)", NoGil());
  m.def("silu_mul", &silu_mul, "silu(gate) * up in the model dtype, in one pass (CPU)", NoGil());
  m.def("rotary", &rotary, "transformers' rotary position embedding of q or k, in one pass (CPU)", NoGil());
  m.def("pack_linear_weight", &pack_linear_weight, "A linear weight [N, K] in panels for packed_linear (CPU)",
        NoGil());
  m.def("packed_linear", &packed_linear, "x W^T + b on panels from pack_linear_weight, for few rows (CPU)",
        py::arg("x"), py::arg("panels"), py::arg("bias"), py::arg("n"), NoGil());
  m.def("quant_linear", &quant_linear, "x W^T + b on GGUF blocks (Q8_0, Q4_0, Q4_1); int8: x quantized to int8 blocks (CPU)",
        py::arg("x"), py::arg("w"), py::arg("qtype"), py::arg("bias"), py::arg("int8") = false, NoGil());
  m.def("quant_dequantize", &quant_dequantize, "Rows of a GGUF-quantized weight as floats of like's dtype (CPU)",
        py::arg("w"), py::arg("qtype"), py::arg("k"), py::arg("rows"), py::arg("like"), NoGil());
  m.def("kquant_linear", &kquant_linear, "x W^T + b on GGUF K-quant super-blocks (Q4_K, Q6_K); int8: x quantized to int8 blocks (CPU)",
        py::arg("x"), py::arg("w"), py::arg("qtype"), py::arg("bias"), py::arg("int8") = false, NoGil());
  m.def("kquant_dequantize", &kquant_dequantize, "Rows of a K-quant weight as floats of like's dtype (CPU)",
        py::arg("w"), py::arg("qtype"), py::arg("k"), py::arg("rows"), py::arg("like"), NoGil());
  m.def("quant_vnni_available", &quant_vnni_available, "Whether this build has VNNI byte dot products");
  m.def("quant_repack_rows", &quant_repack_rows, "Rows a tile of a weight repacked for this build's int8 tiles: 16, 8, or 0 (none)");
  m.def("quant_repack", &quant_repack, "A GGUF weight (Q8_0, Q4_0, Q4_1, Q4_K, Q6_K) with its tiles of rows repacked for the int8 "
        "tiles: multiply it as type + 256 (CPU)", py::arg("w"), py::arg("qtype"), py::arg("k"), NoGil());
  m.def("set_quant_vnni", &set_quant_vnni, "Turn VNNI in quant_linear on or off; returns the previous state",
        py::arg("on"));
  m.def("sample_race", &sample_race, "Each row's token by the exponential race over softmax(logits / T) (T <= 0: "
        "greedy) within its top-p and min-p, its uniforms Philox4x32-10's of the row's key and counter (CPU)",
        py::arg("logits"), py::arg("temperature"), py::arg("top_p"), py::arg("min_p"), py::arg("keys"),
        py::arg("counters"), NoGil());
  m.def("logsumexp_rows", &logsumexp_rows, "log(sum(exp(row))) of each row, read in the logits' own dtype (CPU)",
        NoGil());
  m.def("race_uniforms", &race_uniforms, "The n uniforms sample_race reads for one key and counter", py::arg("key"),
        py::arg("counter"), py::arg("n"), NoGil());
  m.def("linear_panel_width", &linear_panel_width, "Output columns per weight panel of this build");
  // a model's decoder stack, one call per step (decoder_cpu.cpp; engine/backends/cpu_layers.py builds it)
  py::class_<cbserve::PackedLinear>(m, "PackedLinear", "One packed linear layer (cpu_linear.py's PackedWeight)")
      .def(py::init([](c10::optional<at::Tensor> panels, c10::optional<at::Tensor> onednn,
                       c10::optional<at::Tensor> bias, int64_t n, int64_t panel_rows) {
             return cbserve::PackedLinear{panels.value_or(at::Tensor()), onednn.value_or(at::Tensor()),
                                          bias.value_or(at::Tensor()), n, panel_rows};
           }),
           py::arg("panels"), py::arg("onednn"), py::arg("bias"), py::arg("n"), py::arg("panel_rows"))
      .def_static(
          "blocks",
          [](at::Tensor blocks, int64_t qtype, int64_t k, c10::optional<at::Tensor> bias, c10::optional<at::Tensor> out_order,
             bool int8, int64_t dense_rows) {
            cbserve::PackedLinear l;
            l.blocks = blocks, l.qtype = qtype, l.k = k, l.n = blocks.size(0), l.int8 = int8, l.dense_rows = dense_rows;
            l.bias = bias.value_or(at::Tensor()), l.out_order = out_order.value_or(at::Tensor());
            return l;
          },
          "A linear layer in GGUF blocks (cpu_quant.py's QuantizedLinear)", py::arg("blocks"), py::arg("qtype"),
          py::arg("k"), py::arg("bias"), py::arg("out_order"), py::arg("int8"), py::arg("dense_rows"));
  py::class_<cbserve::DecoderStack>(m, "DecoderStack", "A Llama-family decoder stack run in one call per step (CPU)")
      .def(py::init<int64_t, int64_t, int64_t, double>(), py::arg("num_heads"), py::arg("num_kv_heads"),
           py::arg("head_dim"), py::arg("scale"))
      .def("add_layer",
           [](cbserve::DecoderStack& s, const std::vector<cbserve::PackedLinear>& qkv, const cbserve::PackedLinear& o,
              const cbserve::PackedLinear& gate, const cbserve::PackedLinear& up, const cbserve::PackedLinear& down,
              at::Tensor input_norm, double input_eps, at::Tensor post_norm, double post_eps, int64_t window) {
             s.add_layer(cbserve::DecoderLayer{qkv, o, gate, up, down, input_norm, post_norm, input_eps, post_eps, window});
           },
           py::arg("qkv"), py::arg("o"), py::arg("gate"), py::arg("up"), py::arg("down"), py::arg("input_norm"),
           py::arg("input_eps"), py::arg("post_norm"), py::arg("post_eps"), py::arg("window"))
      .def("set_head", &cbserve::DecoderStack::set_head, py::arg("norm"), py::arg("eps"), py::arg("lm_head"))
      .def_property_readonly("num_layers", &cbserve::DecoderStack::num_layers)
      .def("forward", &cbserve::DecoderStack::forward, py::arg("hidden"), py::arg("cos"), py::arg("sin"),
           py::arg("k_caches"), py::arg("v_caches"), py::arg("block_tables"), py::arg("k_lens"), py::arg("q_start"),
           py::arg("slot_mapping"), py::arg("logits_rows"), py::arg("cascade_min_seqs"), NoGil());
  py::class_<cbserve::VersionWatch>(m, "VersionWatch", "The version counters of a list of tensors, summed in one call")
      .def(py::init<const std::vector<at::Tensor>&>(), py::arg("tensors"))
      .def("sum", &cbserve::VersionWatch::sum)
      .def("__len__", &cbserve::VersionWatch::size);
  m.def("lanes", [] { return cbserve::kLanes; }, "Float lanes per vector of this build: 16 (AVX-512) or 8 (AVX2)");
}
