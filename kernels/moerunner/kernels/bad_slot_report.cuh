// Device code that adds a run's bad expert ids (outside [-1, num_experts)) to the caller's
// moe_status (core/types.hpp). Bad ids are rare: the plan builds notice them with the
// block-wide OR they take anyway, and only then count them here, rereading the ids, so the
// common path pays nothing.
#pragma once

#if !defined(__CUDACC__)
#error "moerunner/kernels/bad_slot_report.cuh needs nvcc: include it from a .cu file"
#endif

#include <climits>
#include <cstdint>

#include "moerunner/core/types.hpp"
#include "moerunner/kernels/atomic_saturating.cuh"

namespace moerunner::kernels {

// Neither a local expert nor -1 (a filtered slot).
__device__ __forceinline__ bool bad_expert_id(int id, int num_experts) {
  return id != -1 && (id < -1 || id >= num_experts);
}

// One thread, once per run that found `count` > 0 bad slots, the lowest being `first`: adds
// the count (saturating), and names `first` when the count was zero before (the status was
// clean), so first_bad_slot belongs to the earliest run since the caller zeroed it.
__device__ inline void report_bad_slots(moe_status* status, int count, int first) {
  if (atomic_add_saturating(&status->bad_slots, count) == 0) status->first_bad_slot = first;
}

// The block's count of bad slots and the lowest of them, in shared memory.
struct bad_slot_tally {
  int count;
  int first;
};

// Every thread of the block, with the same arguments: the bad ids of ids[begin, end) counted
// into `tally`.
template <int THREADS>
__device__ __forceinline__ void tally_bad_slots(const std::int32_t* ids, std::int64_t begin, std::int64_t end,
                                                int num_experts, bad_slot_tally& tally) {
  int count = 0, first = INT_MAX;
  for (std::int64_t s = begin + threadIdx.x; s < end; s += THREADS)
    if (bad_expert_id(__ldcg(ids + s), num_experts)) {
      first = count == 0 ? static_cast<int>(s) : first;  // a thread's slots rise
      ++count;
    }
  if (count > 0) {
    atomicAdd(&tally.count, count);
    atomicMin(&tally.first, first);
  }
}

// Every thread of the block, with the same arguments: counts the bad ids of the chunks of
// `chunk` slots (of num_slots) for which has_bad(c) holds, and reports them to `status`.
template <int THREADS, class HasBad>
__device__ void report_block_bad_slots(const std::int32_t* ids, std::int64_t num_slots, std::int64_t chunk,
                                       int chunks, HasBad has_bad, int num_experts, moe_status* status,
                                       bad_slot_tally& tally) {
  if (threadIdx.x == 0) {
    tally.count = 0;
    tally.first = INT_MAX;
  }
  __syncthreads();
  for (int c = 0; c < chunks; ++c)
    if (has_bad(c)) {
      const std::int64_t begin = c * chunk;
      tally_bad_slots<THREADS>(ids, begin, begin + chunk < num_slots ? begin + chunk : num_slots, num_experts, tally);
    }
  __syncthreads();
  if (threadIdx.x == 0 && tally.count > 0) report_bad_slots(status, tally.count, tally.first);
}

}  // namespace moerunner::kernels
