// The version counters of a model's parameters, read in one call. The engine reads them before every
// step to notice weights changed in place; from Python that is a chain of dependent loads per tensor
// (list item, Python object, TensorImpl, counter) through memory the step's weights have just evicted
// from the caches, 0.15-0.2 ms a step for a few hundred tensors. Here the counters are held directly
// and their loads are independent, so the CPU has many misses in flight at once.
#pragma once

#include <torch/extension.h>

#include <vector>

namespace cbserve {

class VersionWatch {
 public:
  // Refuses tensors without a counter (inference tensors): there is nothing to watch.
  explicit VersionWatch(const std::vector<at::Tensor>& tensors) {
    counters_.reserve(tensors.size());
    for (const at::Tensor& t : tensors) {
      const c10::VariableVersion& counter = t.unsafeGetTensorImpl()->version_counter();
      TORCH_CHECK(counter.enabled(), "Inference tensors do not track version counter.");
      counters_.push_back(counter);
    }
  }

  // The sum of the counters: it grows with every in-place change to any of the tensors.
  int64_t sum() const {
    int64_t total = 0;
    for (const c10::VariableVersion& c : counters_) total += c.current_version();
    return total;
  }

  int64_t size() const { return static_cast<int64_t>(counters_.size()); }

 private:
  std::vector<c10::VariableVersion> counters_;
};

}  // namespace cbserve
