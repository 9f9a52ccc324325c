// With two_tu_gpu_b.cu: one program whose two translation units both include every GPU
// header and both instantiate every built-in policy's run (each unit has its own function
// that would run a layer). It links only if nothing in those headers is defined once per
// translation unit, as a plain __global__ function would be. It runs nothing on a GPU.
#include <cstdio>

#include "two_tu_gpu.hpp"

namespace {
void run_from_a(two_tu_gpu::runner& r, const moerunner::DispatchOutput& d, const moerunner::unquantized_quant_info& q,
                const moerunner::tensor_view& out, moerunner::workspace_view ws) {
  r.run(d, q, out, ws, cuda::stream_ref(cudaStream_t{}));
}
}  // namespace

int main() {
  two_tu_gpu::run_fn a = &run_from_a, b = two_tu_gpu::run_from_b();
  std::printf("both translation units instantiated the built-in runners: %s\n", a != b && b != nullptr ? "yes" : "no");
  return a != b && b != nullptr ? 0 : 1;
}
