// With two_tu_gpu_b.cu: one program whose two translation units both include every GPU
// header and both instantiate every built-in policy's run for both weight formats (each unit
// has its own functions that would run a layer). It links only if nothing in those headers is
// defined once per translation unit, as a plain __global__ function would be. It runs nothing on
// a GPU, so it is built as PTX only (no machine code to make).
#include <cstdio>

#include "two_tu_gpu.hpp"

namespace {
void run_from_a(two_tu_gpu::runner& r, const moerunner::DispatchOutput& d, const moerunner::unquantized_quant_info& q,
                const moerunner::tensor_view& out, moerunner::workspace_view ws) {
  r.run(d, q, out, ws, cuda::stream_ref(cudaStream_t{}));
}
void run_fp8_from_a(two_tu_gpu::runner& r, const moerunner::DispatchOutput& d, const moerunner::fp8_block_quant_info& q,
                    const moerunner::tensor_view& out, moerunner::workspace_view ws) {
  r.run(d, q, out, ws, cuda::stream_ref(cudaStream_t{}));
}
}  // namespace

int main() {
  two_tu_gpu::run_fn a = &run_from_a, b = two_tu_gpu::run_from_b();
  two_tu_gpu::run_fp8_fn a8 = &run_fp8_from_a, b8 = two_tu_gpu::run_fp8_from_b();
  const bool ok = a != b && b != nullptr && a8 != b8 && b8 != nullptr;
  std::printf("both translation units instantiated the built-in runners: %s\n", ok ? "yes" : "no");
  return ok ? 0 : 1;
}
