// The routing plan's order, written once for the GPU kernel that builds it per CTA at decode
// (kernels/moerunner/kernels/kernel_local_plan.cuh) and the host test that checks it: rows
// sorted by expert, then by slot; M tiles of block_m rows, experts in order. Each function is
// one slot's (one thread's) share, over the experts of all slots (-1 for a slot left out).
#pragma once

#include <cstdint>

#include "moerunner/core/portable_math.hpp"

namespace moerunner::routing {

// Slot t of expert expert[t] >= 0: its row is before + rank, its expert holds rows
// [before, before + count).
struct slot_place {
  int before = 0;  // rows of smaller experts
  int rank = 0;    // earlier slots of the same expert
  int count = 0;   // slots of the same expert
};

MOERUNNER_HD inline slot_place place_of_slot(const std::int32_t* expert, int slots, int t) {
  const int e = expert[t];
  slot_place p;
  for (int j = 0; j < slots; ++j) {
    const int o = expert[j];
    p.before += (o >= 0 && o < e) ? 1 : 0;
    p.count += o == e ? 1 : 0;
    p.rank += (o == e && j < t) ? 1 : 0;
  }
  return p;
}

MOERUNNER_HD inline int m_tiles_for(int rows, int block_m) { return (rows + block_m - 1) / block_m; }

// Rows [begin, end) of the i-th M tile of slot `at`'s expert, i < m_tiles_for(at.count, block_m).
MOERUNNER_HD inline void expert_tile_rows(const slot_place& at, int i, int block_m, int& begin, int& end) {
  begin = at.before + i * block_m;
  end = at.count - i * block_m < block_m ? at.before + at.count : begin + block_m;
}

// The first M tile of expert e, given first_count[j]: slot j's expert's count at the expert's
// first slot (rank 0), else 0, so that each expert is counted once.
MOERUNNER_HD inline int first_tile_of(const std::int32_t* expert, const std::int32_t* first_count, int slots, int e,
                                      int block_m) {
  int tile = 0;
  for (int j = 0; j < slots; ++j)
    if (first_count[j] > 0 && expert[j] < e) tile += m_tiles_for(first_count[j], block_m);
  return tile;
}

// The M tiles of all experts, from first_count as above.
MOERUNNER_HD inline int tiles_total(const std::int32_t* first_count, int slots, int block_m) {
  int total = 0;
  for (int j = 0; j < slots; ++j) total += m_tiles_for(first_count[j], block_m);
  return total;
}

}  // namespace moerunner::routing
