// Every size limit the library enforces, in one place; the config, routing (host and
// device), the GPU plan and the error messages all read these constants.
#pragma once

#include <cstddef>

namespace moerunner {

// The runner (MoeRunnerConfig): what every backend accepts.
inline constexpr int max_num_experts = 4096;  // the GPU tile schedule scans per-expert counts in one 1024-thread block, 4 each
inline constexpr int max_top_k = 32;          // 4x the largest routed k in use (8); bounds the [M, k] tensors and combine loops
inline constexpr int max_feature_size = 1 << 20;  // hidden and intermediate sizes: 2I and block counts stay far inside int

// The GPU backends (cuda_fused, cublas_grouped): the routing plan's tiling fixes its scratch size.
inline constexpr int max_gpu_local_experts = 1024;  // one expert per thread of the plan's offset scan

// Expert parallelism on the GPU (ep_nccl_dispatcher): its kernels keep one offset per rank in shared memory.
inline constexpr int max_ep_world_size = 64;  // 8x the largest expert-parallel group within a node in use (8)

// Tensors and names.
inline constexpr int max_tensor_rank = 4;                 // the widest argument is [M, k, H] (no_combine) plus one
inline constexpr std::size_t max_backend_name_length = 63;  // a backend_id holds its name inline, in 64 bytes with its length
inline constexpr std::size_t max_echoed_chars = 80;       // a user string quoted in an error is cut here (one log line)

// Top-k routing (reference::topk and gpu::topk), bounded by the device kernel: one warp per token.
namespace routing {
inline constexpr int max_routing_experts = 512;  // a lane holds 16 experts' scores in registers: 16 x 32 lanes
inline constexpr int max_routing_top_k = 16;     // the k selection rounds run one after another; 2x any routed k in use
inline constexpr int max_expert_groups = 32;     // group scores are ranked one group per lane
}  // namespace routing

}  // namespace moerunner
