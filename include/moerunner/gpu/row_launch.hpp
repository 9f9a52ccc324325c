// Launch shape shared by the row kernels (gather, activation, combine): each block covers
// one chunk of one row, so a decode-sized batch still spreads a long row over many blocks.
#pragma once

#include <algorithm>
#include <cstdint>

namespace moerunner::gpu {

struct row_launch {
  unsigned threads = 0;             // per block; each thread handles one vector of the row
  std::int64_t chunks_per_row = 0;  // blocks per row
  std::int64_t blocks = 0;          // rows * chunks_per_row; the kernels stride over it
  unsigned grid = 0;
};

inline row_launch make_row_launch(std::int64_t rows, std::int64_t vecs_per_row) {
  constexpr std::int64_t max_threads = 128, max_grid = std::int64_t{1} << 30;
  row_launch l;
  l.threads = static_cast<unsigned>(std::min(max_threads, (vecs_per_row + 31) / 32 * 32));
  l.chunks_per_row = (vecs_per_row + l.threads - 1) / l.threads;
  l.blocks = rows * l.chunks_per_row;
  l.grid = static_cast<unsigned>(std::min(l.blocks, max_grid));
  return l;
}

}  // namespace moerunner::gpu
