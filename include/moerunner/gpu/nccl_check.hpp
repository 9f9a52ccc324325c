// NCCL status checking for launch code: every NCCL call is checked and a failure becomes a
// cuda_error naming the call, the place and NCCL's own words. Only expert parallelism includes
// it (it needs <nccl.h>).
#pragma once

#include <string>

#include <nccl.h>

#include "moerunner/core/error.hpp"

namespace moerunner::gpu {

inline void check_nccl(ncclResult_t status, const char* what, const char* file, int line) {
  if (status != ncclSuccess)
    throw cuda_error(std::string(what) + " failed at " + file + ":" + std::to_string(line) + ": " +
                     ncclGetErrorString(status));
}

}  // namespace moerunner::gpu

#define MOE_NCCL_CHECK(expr) ::moerunner::gpu::check_nccl((expr), #expr, __FILE__, __LINE__)
