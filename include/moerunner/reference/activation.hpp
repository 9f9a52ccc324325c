// The gated activations, in double, as the reference defines them.
#pragma once

#include <algorithm>
#include <cmath>

#include "moerunner/core/config.hpp"

namespace moerunner::reference {

inline double silu(double x) { return x / (1.0 + std::exp(-x)); }
inline double gelu(double x) { return 0.5 * x * (1.0 + std::erf(x / std::sqrt(2.0))); }  // exact (erf) GELU

// gate/up -> one intermediate value; for non-gated configs `up` is unused.
inline double apply_activation(const activation& a, bool gated, double gate, double up) {
  switch (a.kind) {
    case activation_kind::silu: return gated ? silu(gate) * up : silu(gate);
    case activation_kind::gelu: return gated ? gelu(gate) * up : gelu(gate);
    case activation_kind::swiglu_clamped: {
      const double g = std::min(gate, static_cast<double>(a.limit));
      const double u = std::clamp(up, -static_cast<double>(a.limit), static_cast<double>(a.limit));
      return (u + 1.0) * g / (1.0 + std::exp(-static_cast<double>(a.alpha) * g));
    }
  }
  return 0.0;
}

}  // namespace moerunner::reference
