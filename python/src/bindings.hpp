// The parts of the extension module, each defined in its own file.
#pragma once

#include <string>
#include <string_view>

#include <nanobind/nanobind.h>

#include "moerunner/moerunner.hpp"

namespace moerunner::python {

void bind_runner(nanobind::module_& m);  // bind_runner.cpp: Runner
void bind_topk(nanobind::module_& m);    // bind_topk.cpp: topk

// The enumerator of E whose name(e) is `s`, for the enums the Python API takes as strings; the
// error names the argument and the accepted values, as the library's enum checks do.
template <class E, class Name, std::size_t N>
E parse_enum(std::string_view s, const E (&values)[N], Name name, const char* where, const char* what) {
  std::string accepted;
  for (E v : values) {
    if (name(v) == s) return v;
    accepted += (accepted.empty() ? "" : ", ") + std::string(name(v));
  }
  detail::throw_invalid(where, std::string(what) + " must be one of " + accepted + ", got '" + detail::echo(s) + "'");
}

}  // namespace moerunner::python
