// What the benchmark programs share: CUDA-event timing, graph capture, JSON-lines output.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <sstream>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <cuda_runtime_api.h>

#include "moerunner/gpu/cuda_check.hpp"

namespace bench_util {

class event_pair {
 public:
  event_pair() {
    MOE_CUDA_CHECK(cudaEventCreate(&a_));
    MOE_CUDA_CHECK(cudaEventCreate(&b_));
  }
  event_pair(const event_pair&) = delete;
  event_pair& operator=(const event_pair&) = delete;
  ~event_pair() {
    cudaEventDestroy(a_);
    cudaEventDestroy(b_);
  }
  void start(cudaStream_t s) { MOE_CUDA_CHECK(cudaEventRecord(a_, s)); }
  float stop_ms(cudaStream_t s) {
    MOE_CUDA_CHECK(cudaEventRecord(b_, s));
    MOE_CUDA_CHECK(cudaEventSynchronize(b_));
    float ms = 0.0f;
    MOE_CUDA_CHECK(cudaEventElapsedTime(&ms, a_, b_));
    return ms;
  }

 private:
  cudaEvent_t a_ = nullptr, b_ = nullptr;
};

inline double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const std::size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

class graph_exec {
 public:
  graph_exec() = default;
  graph_exec(const graph_exec&) = delete;
  graph_exec& operator=(const graph_exec&) = delete;
  graph_exec(graph_exec&& o) noexcept : exec_(std::exchange(o.exec_, nullptr)) {}
  ~graph_exec() {
    if (exec_) cudaGraphExecDestroy(exec_);
  }
  // Captures f(stream) into a graph; a throw inside f ends the capture before it propagates.
  template <class F>
  static graph_exec capture(cudaStream_t s, F&& f) {
    MOE_CUDA_CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
    cudaGraph_t g = nullptr;
    try {
      f(s);
    } catch (...) {
      cudaStreamEndCapture(s, &g);
      if (g) cudaGraphDestroy(g);
      throw;
    }
    MOE_CUDA_CHECK(cudaStreamEndCapture(s, &g));
    graph_exec out;
    const cudaError_t inst = cudaGraphInstantiate(&out.exec_, g, 0);
    cudaGraphDestroy(g);
    MOE_CUDA_CHECK(inst);
    return out;
  }
  void launch(cudaStream_t s) const { MOE_CUDA_CHECK(cudaGraphLaunch(exec_, s)); }

 private:
  cudaGraphExec_t exec_ = nullptr;
};

inline std::string json_number(double v) {
  if (!std::isfinite(v)) return "null";
  char buf[64];
  std::snprintf(buf, sizeof buf, "%.6g", v);
  return buf;
}

inline std::string json_string(std::string_view s) {
  std::string o = "\"";
  for (char c : s) {
    if (c == '"' || c == '\\') o += '\\';
    if (static_cast<unsigned char>(c) < 0x20) continue;
    o += c;
  }
  return o + "\"";
}

inline std::string utc_now() {
  const std::time_t t = std::time(nullptr);
  char buf[32];
  std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&t));
  return buf;
}

inline std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  for (std::string item; std::getline(ss, item, ',');)
    if (!item.empty()) out.push_back(item);
  return out;
}


// The value after option argv[a] (a moves onto it); exits with status 2 where there is none.
inline std::string option_value(int& a, int argc, char** argv, const char* program) {
  if (a + 1 >= argc) {
    std::fprintf(stderr, "%s: %s needs a value\n", program, argv[a]);
    std::exit(2);
  }
  return argv[++a];
}

}  // namespace bench_util
