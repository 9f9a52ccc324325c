// CUDA error checking for launch code: every runtime call and every launch is checked.
#pragma once

#include <string>

#include <cuda_runtime_api.h>

#include "moerunner/core/error.hpp"

namespace moerunner::gpu {

// A failed call is reported once, here: the runtime also keeps it as the thread's last error,
// which the next launch check (cudaGetLastError) would report again as that launch's failure,
// so it is cleared before the throw. (A sticky error stays: every later call reports it anyway.)
inline void check_cuda(cudaError_t status, const char* what, const char* file, int line) {
  if (status == cudaSuccess) return;
  (void)cudaGetLastError();
  throw cuda_error(std::string(what) + " failed at " + file + ":" + std::to_string(line) + ": " +
                   cudaGetErrorName(status) + " (" + cudaGetErrorString(status) + ")");
}

}  // namespace moerunner::gpu

#define MOE_CUDA_CHECK(expr) ::moerunner::gpu::check_cuda((expr), #expr, __FILE__, __LINE__)
// After a <<<>>> launch: reports configuration errors without synchronizing.
#define MOE_CUDA_CHECK_LAUNCH(name) ::moerunner::gpu::check_cuda(cudaGetLastError(), name, __FILE__, __LINE__)
