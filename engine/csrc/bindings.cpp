// The Python module of cbserve's CPU kernels: one binding per kernel file.
#include <torch/extension.h>

#include "vec.h"

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
bool set_quant_vnni(bool on);

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
  m.def("quant_vnni_available", &quant_vnni_available, "Whether this build has VNNI byte dot products");
  m.def("set_quant_vnni", &set_quant_vnni, "Turn VNNI in quant_linear on or off; returns the previous state",
        py::arg("on"));
  m.def("linear_panel_width", &linear_panel_width, "Output columns per weight panel of this build");
  m.def("lanes", [] { return cbserve::kLanes; }, "Float lanes per vector of this build: 16 (AVX-512) or 8 (AVX2)");
}
