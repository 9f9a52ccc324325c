// What both translation units of the two-unit GPU link test include: every GPU header.
#pragma once

#include "moerunner/gpu/plan_schedule.cuh"
#include "moerunner/gpu/routing.cuh"
#include "moerunner/moerunner.hpp"
#include "moerunner/policies/builtin_policies.cuh"

namespace two_tu_gpu {
using runner = moerunner::builtin_moe_runner<>;
using run_fn = void (*)(runner&, const moerunner::DispatchOutput&, const moerunner::unquantized_quant_info&,
                        const moerunner::tensor_view&, moerunner::workspace_view);
using run_fp8_fn = void (*)(runner&, const moerunner::DispatchOutput&, const moerunner::fp8_block_quant_info&,
                            const moerunner::tensor_view&, moerunner::workspace_view);
run_fn run_from_b();
run_fp8_fn run_fp8_from_b();
}  // namespace two_tu_gpu
