// cuBLAS status checking for launch code: every cuBLAS call is checked and a
// failure becomes a cuda_error naming the call, the place and cuBLAS's own words.
#pragma once

#include <string>

#include <cublas_api.h>

#include "moerunner/core/error.hpp"

namespace moerunner::gpu {

inline void check_cublas(cublasStatus_t status, const char* what, const char* file, int line) {
  if (status != CUBLAS_STATUS_SUCCESS)
    throw cuda_error(std::string(what) + " failed at " + file + ":" + std::to_string(line) + ": " +
                     cublasGetStatusName(status) + " (" + cublasGetStatusString(status) + ")");
}

}  // namespace moerunner::gpu

#define MOE_CUBLAS_CHECK(expr) ::moerunner::gpu::check_cublas((expr), #expr, __FILE__, __LINE__)
