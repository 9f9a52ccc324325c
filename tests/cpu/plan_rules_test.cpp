// routing/plan_rules.hpp, the per-slot arithmetic the decode GEMMs use to build the plan's
// row order and M tiles in shared memory, run here slot by slot as the GPU's threads run it,
// against a stable sort of the slots by expert on random ids (left-out and out-of-range ones
// included), for every slot count the GEMMs take.
#include <doctest/doctest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include "../common/test_seed.hpp"
#include "moerunner/routing/plan_rules.hpp"

namespace rt = moerunner::routing;

namespace {

struct tile {
  int expert, begin, end;
  bool operator==(const tile&) const = default;
};

struct built {
  std::vector<std::int32_t> row_to_slot;  // -1 where no slot landed
  std::vector<tile> tiles;
  int total = 0;
  int collisions = 0;  // rows two slots claimed
};

// The two phases of the block, each over all threads, as kernel_local_plan.cuh runs them.
built run_rules(const std::vector<std::int32_t>& expert, int block_m) {
  const int slots = static_cast<int>(expert.size());
  built b;
  b.row_to_slot.assign(expert.size(), -1);
  std::vector<std::int32_t> first_count(expert.size(), 0);
  std::vector<rt::slot_place> at(expert.size());
  for (int t = 0; t < slots; ++t) {
    if (expert[t] < 0) continue;
    at[t] = rt::place_of_slot(expert.data(), slots, t);
    std::int32_t& r = b.row_to_slot.at(at[t].before + at[t].rank);
    b.collisions += r != -1 ? 1 : 0;
    r = t;
    if (at[t].rank == 0) first_count[t] = at[t].count;
  }
  b.total = rt::tiles_total(first_count.data(), slots, block_m);
  b.tiles.assign(static_cast<std::size_t>(b.total), tile{-1, -1, -1});
  for (int t = 0; t < slots; ++t) {
    if (expert[t] < 0 || at[t].rank != 0) continue;
    const int first = rt::first_tile_of(expert.data(), first_count.data(), slots, expert[t], block_m);
    for (int i = 0; i < rt::m_tiles_for(at[t].count, block_m); ++i) {
      int begin = 0, end = 0;
      rt::expert_tile_rows(at[t], i, block_m, begin, end);
      b.tiles.at(first + i) = tile{expert[t], begin, end};
    }
  }
  return b;
}

// The plan kernel's order, written plainly: a stable sort by expert, tiles cut per expert.
built reference(const std::vector<std::int32_t>& expert, int num_experts, int block_m) {
  built b;
  b.row_to_slot.assign(expert.size(), -1);
  std::vector<std::int32_t> order;
  for (int t = 0; t < static_cast<int>(expert.size()); ++t)
    if (expert[t] >= 0) order.push_back(t);
  std::stable_sort(order.begin(), order.end(), [&](int a, int c) { return expert[a] < expert[c]; });
  std::copy(order.begin(), order.end(), b.row_to_slot.begin());
  int row = 0;
  for (int e = 0; e < num_experts; ++e) {
    const int n = static_cast<int>(std::count(expert.begin(), expert.end(), e));
    for (int begin = row; begin < row + n; begin += block_m)
      b.tiles.push_back({e, begin, std::min(begin + block_m, row + n)});
    row += n;
  }
  b.total = static_cast<int>(b.tiles.size());
  return b;
}

}  // namespace

TEST_CASE("the per-slot plan rules give the plan kernel's rows and tiles") {
  const unsigned seed = moerunner::test::test_seed();
  CAPTURE(seed);
  std::mt19937 rng(seed);
  for (int num_experts : {1, 3, 8, 64, 128, 256})
    for (int block_m : {1, 3, 8, 64})
      for (int slots = 0; slots <= 64; ++slots) {
        CAPTURE(num_experts);
        CAPTURE(block_m);
        CAPTURE(slots);
        // Ids as the kernel reads them: in range, -1, or out of range (both left out).
        std::uniform_int_distribution<int> pick(-3, num_experts + 2);
        std::uniform_int_distribution<int> few(0, std::min(num_experts, 3) - 1);
        const bool crowded = slots % 2 == 0;  // half the cases on at most three experts
        std::vector<std::int32_t> expert(static_cast<std::size_t>(slots));
        for (std::int32_t& e : expert) {
          const int id = crowded ? few(rng) : pick(rng);
          e = id >= 0 && id < num_experts ? id : -1;
        }
        const built got = run_rules(expert, block_m);
        const built want = reference(expert, num_experts, block_m);
        CHECK(got.collisions == 0);
        CHECK(got.row_to_slot == want.row_to_slot);
        CHECK(got.total == want.total);
        CHECK(got.tiles == want.tiles);
      }
}

TEST_CASE("the per-slot plan rules: every slot on one expert, and none") {
  const std::vector<std::int32_t> one(64, 5), none(64, -1);
  const built a = run_rules(one, 8);
  CHECK(a.total == 8);
  CHECK(a.tiles.front() == tile{5, 0, 8});
  CHECK(a.tiles.back() == tile{5, 56, 64});
  for (int r = 0; r < 64; ++r) CHECK(a.row_to_slot[r] == r);
  const built b = run_rules(none, 8);
  CHECK(b.total == 0);
  CHECK(std::all_of(b.row_to_slot.begin(), b.row_to_slot.end(), [](std::int32_t s) { return s == -1; }));
}
