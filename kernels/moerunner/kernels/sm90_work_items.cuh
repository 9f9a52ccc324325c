// Work items of a persistent wgmma grouped GEMM handed out at run time (sm_90a only), shared by
// the 16-bit and fp8 kernels.
//
// In fixed turns cluster c runs items c, c + C, c + 2C, ... (C clusters). The clusters that
// share a weight tile then run it together only as long as they keep pace; a cluster that falls
// behind re-reads its tiles from HBM once the others have moved on (DeepSeek-V3 fp8 at 16384
// tokens: 33% L2 hits in GEMM1, bench/NOTES.md round 18). Handed out, a cluster runs item c
// first and then whichever item is next when it asks, so the clusters stay on neighbouring
// items and each weight tile is read from HBM about once per band of M tiles.
//
// One thread per cluster, the taker (thread 0 of rank 0), asks a global counter for the next
// item (atomicAdd) when its cluster starts an item, so the atomic's latency hides behind the
// item's loads, and publishes the answer once the producer has issued that item's last K tile:
// into a small ring in shared memory (the peer's too, through the cluster's shared window),
// completing the slot's `full` barrier. Every warp of the cluster that walks the items reads the
// slot and then arrives on the taker's `empty` barrier of that slot, which the taker waits on
// before it writes that slot again. The producer publishes ahead of the consumers (it runs
// stages K tiles ahead), so a consumer never waits for an item it could not start anyway.
//
// The counter counts asks: every cluster with a first item asks once per item it runs (the last
// answer is past the end), so there are exactly `work` asks, and the one answered work - 1 sets
// the counter back to 0 for the next launch. The schedule writers zero it too, for a workspace's
// first use (kernel_tile_schedule.cuh).
#pragma once

#if !defined(__CUDACC__)
#error "moerunner/kernels/sm90_work_items.cuh needs nvcc: include it from a .cu file"
#endif

#include <cstdint>
#include <type_traits>

#include <cuda/ptx>

#include "moerunner/kernels/kernel_grouped_gemm.cuh"
#include "moerunner/kernels/sm90_cluster_tiles.cuh"
#include "moerunner/kernels/sm90_ptx.cuh"

namespace moerunner::kernels {

struct work_item_ring {
  // Deeper than any kernel's stages: the producer, at most `stages` K tiles ahead of the
  // consumers, never waits for a slot to be read.
  static constexpr int depth = 16;
  std::int32_t item[depth];
  std::uint64_t full[depth];   // one arrival: the taker's
  std::uint64_t empty[depth];  // rank 0's counts every reading warp of the cluster
};

// Thread 0 of each CTA, before the kernel's mbarrier-init fence and cluster barrier. `readers`:
// the warps of one CTA that read every item (all CTAs of a cluster alike).
template <int Cluster>
__device__ __forceinline__ void init_work_item_ring(work_item_ring& r, int readers) {
  for (int s = 0; s < work_item_ring::depth; ++s) {
    cuda::ptx::mbarrier_init(&r.full[s], 1);
    cuda::ptx::mbarrier_init(&r.empty[s], readers * Cluster);
  }
}

namespace work_items_detail {

// Waits with cluster-scope acquire: the slot may have been written by the peer CTA.
__device__ __forceinline__ void wait_cluster(std::uint64_t* bar, std::uint32_t parity) {
#if defined(MOERUNNER_BARRIER_WATCHDOG)
  const long long start = clock64();
  while (!cuda::ptx::mbarrier_try_wait_parity(cuda::ptx::sem_acquire, cuda::ptx::scope_cluster, bar, parity)) {
    if (clock64() - start > (1ll << 33)) {
      printf("moerunner: work item ring wait stalled: block %u thread %u\n", blockIdx.x, threadIdx.x);
      __trap();
    }
  }
#else
  while (!cuda::ptx::mbarrier_try_wait_parity(cuda::ptx::sem_acquire, cuda::ptx::scope_cluster, bar, parity)) {
  }
#endif
}

// One cluster-scope release arrival on `bar` of this CTA (rank == own) or of cluster CTA `rank`.
__device__ __forceinline__ void arrive_release_cluster(std::uint64_t* bar, std::uint32_t rank) {
#if MOERUNNER_WGMMA_COMPILED
  asm volatile(
      "{\n.reg .b32 remote;\n"
      "mapa.shared::cluster.u32 remote, %0, %1;\n"
      "mbarrier.arrive.release.cluster.shared::cluster.b64 _, [remote];\n}\n" ::"r"(smem_address(bar)),
      "r"(rank)
      : "memory");
#else
  (void)bar, (void)rank;
#endif
}

// Stores v at `p`'s offset in the shared memory of cluster CTA `rank`.
__device__ __forceinline__ void store_cluster(std::int32_t* p, std::uint32_t rank, std::int32_t v) {
#if MOERUNNER_WGMMA_COMPILED
  asm volatile(
      "{\n.reg .b32 remote;\n"
      "mapa.shared::cluster.u32 remote, %0, %1;\n"
      "st.shared::cluster.b32 [remote], %2;\n}\n" ::"r"(smem_address(p)),
      "r"(rank), "r"(v)
      : "memory");
#else
  (void)p, (void)rank, (void)v;
#endif
}

}  // namespace work_items_detail

// The items one role of a CTA walks (every thread of the role holds one): in fixed turns, or
// (HandOut) from the ring. Use: for (w = first(); w < work; w = next_warp(w)); the producer
// calls ask() as its item starts and publish() after its last K tile, before next(). Item
// numbers are 64-bit in fixed turns and 32-bit handed out (the launch checks that they fit).
// Every thread of a reading warp calls next_warp(), or a role of one thread next_thread().
template <bool HandOut, int Cluster>
struct item_loop {
  using index = std::conditional_t<HandOut, std::int32_t, std::int64_t>;
  cta_place me;
  index work;
  work_item_ring* ring = nullptr;
  std::int32_t* counter = nullptr;
  std::uint32_t seq = 0;   // items read so far (the first is not read)
  std::int32_t asked = 0;  // the taker's last answer

  __device__ __forceinline__ index first() const { return me.first; }

  // Whether this thread asks for the items: thread 0 of rank 0.
  __device__ __forceinline__ bool taker() const { return HandOut && threadIdx.x == 0 && me.rank == 0; }

  __device__ __forceinline__ void ask() {
    if constexpr (HandOut) {
      if (taker()) {
        asked = atomicAdd(counter, 1);
        if (asked == work - 1) *counter = 0;  // the last ask of this launch: see the top
      }
    }
  }

  // The taker: the answer of its last ask() into the next slot of every ring of the cluster.
  __device__ __forceinline__ void publish() {
    if constexpr (HandOut) {
      if (!taker()) return;
      const int slot = static_cast<int>(seq % work_item_ring::depth);
      const std::uint32_t round = seq / work_item_ring::depth;
      // Every reader of the slot's previous round has read it (a fresh barrier passes parity 1).
      work_items_detail::wait_cluster(&ring->empty[slot], (round & 1) ^ 1);
      const std::int32_t item = asked + me.stride;
      ring->item[slot] = item;
      if constexpr (Cluster == 2) work_items_detail::store_cluster(&ring->item[slot], 1, item);
      work_items_detail::arrive_release_cluster(&ring->full[slot], 0);
      if constexpr (Cluster == 2) work_items_detail::arrive_release_cluster(&ring->full[slot], 1);
    }
  }

  // The item after w. HandOut: waits for its slot, and once the whole warp has read it, lane 0
  // tells the taker's CTA so.
  __device__ __forceinline__ index next_warp(index w) {
    if constexpr (!HandOut) {
      return w + me.stride;
    } else {
      const int slot = static_cast<int>(seq % work_item_ring::depth);
      const std::int32_t item = read(slot);
      __syncwarp();
      if (threadIdx.x % 32 == 0) work_items_detail::arrive_release_cluster(&ring->empty[slot], 0);
      return item;
    }
  }

  // The same for a role of one thread (counted as one reading warp).
  __device__ __forceinline__ index next_thread(index w) {
    if constexpr (!HandOut) {
      return w + me.stride;
    } else {
      const int slot = static_cast<int>(seq % work_item_ring::depth);
      const std::int32_t item = read(slot);
      work_items_detail::arrive_release_cluster(&ring->empty[slot], 0);
      return item;
    }
  }

 private:
  __device__ __forceinline__ std::int32_t read(int slot) {
    const std::uint32_t round = seq / work_item_ring::depth;
    ++seq;
    work_items_detail::wait_cluster(&ring->full[slot], round & 1);
    return *static_cast<volatile std::int32_t*>(&ring->item[slot]);
  }
};

// The loop over `tiles` M tiles times n_tiles times k_splits items.
template <bool HandOut, int Cluster>
__device__ __forceinline__ item_loop<HandOut, Cluster> make_item_loop(int tiles, int n_tiles, int k_splits,
                                                                      work_item_ring* ring, std::int32_t* counter) {
  using index = typename item_loop<HandOut, Cluster>::index;
  item_loop<HandOut, Cluster> l;
  l.me = cluster_place<Cluster>();
  l.work = static_cast<index>(tiles) * n_tiles * k_splits;
  l.ring = ring;
  l.counter = counter;
  return l;
}

}  // namespace moerunner::kernels
