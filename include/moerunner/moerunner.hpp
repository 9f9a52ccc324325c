// moerunner: the whole public host API in one include.
// GPU policies (which need nvcc) are included separately:
//   <moerunner/policies/cuda_fused_policy.cuh>, <moerunner/policies/cublas_grouped_policy.cuh>.
#pragma once

#include "moerunner/core/backend_id.hpp"
#include "moerunner/core/concepts.hpp"
#include "moerunner/core/config.hpp"
#include "moerunner/core/dtype.hpp"
#include "moerunner/core/error.hpp"
#include "moerunner/core/tensor_view.hpp"
#include "moerunner/core/types.hpp"
#include "moerunner/dispatch/standard_dispatcher.hpp"
#include "moerunner/layer/fused_moe.hpp"
#include "moerunner/lora/lora.hpp"
#include "moerunner/policies/reference_policy.hpp"
#include "moerunner/quant/quant_info.hpp"
#include "moerunner/quant/quant_methods.hpp"
#include "moerunner/reference/routing.hpp"
#include "moerunner/registry/backend_registry.hpp"
#include "moerunner/registry/register_backend.hpp"
#include "moerunner/runner/moe_runner.hpp"
