// The second translation unit of the two-unit GPU link test (see two_tu_gpu_a.cu).
#include "two_tu_gpu.hpp"

namespace {
void run_from_b(two_tu_gpu::runner& r, const moerunner::DispatchOutput& d, const moerunner::unquantized_quant_info& q,
                const moerunner::tensor_view& out, moerunner::workspace_view ws) {
  r.run(d, q, out, ws, cuda::stream_ref(cudaStream_t{}));
}
void run_fp8_from_b(two_tu_gpu::runner& r, const moerunner::DispatchOutput& d, const moerunner::fp8_block_quant_info& q,
                    const moerunner::tensor_view& out, moerunner::workspace_view ws) {
  r.run(d, q, out, ws, cuda::stream_ref(cudaStream_t{}));
}
}  // namespace

two_tu_gpu::run_fn two_tu_gpu::run_from_b() { return &::run_from_b; }
two_tu_gpu::run_fp8_fn two_tu_gpu::run_fp8_from_b() { return &::run_fp8_from_b; }
