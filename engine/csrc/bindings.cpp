// The Python module of cbserve's CPU kernels: one binding per kernel file.
#include <torch/extension.h>

void paged_attention(at::Tensor out, at::Tensor q, at::Tensor k_cache, at::Tensor v_cache, at::Tensor block_tables,
                     at::Tensor k_lens, at::Tensor q_start, double scale, int64_t window);
at::Tensor argmax_rows(at::Tensor logits);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "Attention over the paged KV cache for a whole step (CPU)");
  m.def("argmax_rows", &argmax_rows, "Index of each row's largest value, in the tensor's own dtype (CPU)");
}
