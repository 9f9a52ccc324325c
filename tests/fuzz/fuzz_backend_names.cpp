// libFuzzer target for backend names: name validation and registry resolve.
//
// Invariants checked on every input:
//  - backend_name_problem accepts exactly the names that are non-empty, at most 63
//    characters and printable ASCII without spaces;
//  - is_builtin_name and backend_id::is_builtin agree;
//  - resolve either returns a backend_id holding the very same name (and only for a
//    built-in or registered name) or throws registry_error listing the known names,
//    its message printable whatever bytes the name held;
//  - nothing else escapes, and nothing crashes (ASan/UBSan watch the rest).
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include "moerunner/moerunner.hpp"

namespace {

struct fuzz_policy {
  static constexpr std::string_view name = "fuzz_policy";
  static constexpr moerunner::memory_space tensor_space = moerunner::memory_space::host;
  using quant_infos = moerunner::quant_info_list<moerunner::unquantized_quant_info>;

  explicit fuzz_policy(const moerunner::MoeRunnerConfig&) {}
  std::size_t workspace_bytes(std::int64_t) const { return 0; }
  moerunner::CombineInput run_from_dispatch(const moerunner::DispatchOutput&, const moerunner::unquantized_quant_info&,
                                            const moerunner::tensor_view& out, moerunner::workspace_view,
                                            cuda::stream_ref) {
    return {out, true};
  }
};

[[noreturn]] void violated(const char* invariant, std::string_view name) {
  std::string hex;
  for (unsigned char c : name) {
    const char digits[] = "0123456789abcdef";
    hex += digits[c >> 4];
    hex += digits[c & 15];
  }
  std::fprintf(stderr, "invariant violated: %s (name bytes: %s)\n", invariant, hex.c_str());
  std::abort();
}

bool well_formed(std::string_view name) {
  if (name.empty() || name.size() > moerunner::max_backend_name_length) return false;
  for (char c : name)
    if (c < '!' || c > '~') return false;
  return true;
}

// A caller-owned registry, so that the fuzzer never touches the process-wide one.
moerunner::backend_registry& fuzz_registry() {
  static moerunner::backend_registry* registry = [] {
    auto* r = new moerunner::backend_registry;
    r->add<fuzz_policy>({__FILE__, __LINE__}, moerunner::registration_kind::new_backend);
    std::string expected;
    for (const auto& b : moerunner::builtin::all) expected += std::string(b.id.name()) + ", ";
    if (r->known_names() != expected + "fuzz_policy")
      violated("known_names does not list the built-ins and then the registered name", "");
    return r;
  }();
  return *registry;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const std::string_view name(reinterpret_cast<const char*>(data), size);

  const std::string_view problem = moerunner::backend_name_problem(name);
  if (problem.empty() != well_formed(name)) violated("backend_name_problem disagrees with the naming rule", name);

  const bool builtin = moerunner::is_builtin_name(name);
  if (builtin && !problem.empty()) violated("a built-in name is malformed", name);
  if (well_formed(name) && moerunner::backend_id(name).is_builtin() != builtin)
    violated("backend_id::is_builtin disagrees with is_builtin_name", name);

  auto& registry = fuzz_registry();
  const bool registered = name == fuzz_policy::name;
  try {
    const moerunner::backend_id id = registry.resolve(name);
    if (id.name() != name) violated("resolve returned a different name", name);
    if (!builtin && !registered) violated("resolve accepted a name that is neither built in nor registered", name);
  } catch (const moerunner::registry_error& e) {
    if (builtin || registered) violated("resolve rejected a known name", name);
    const std::string listed = "known backends: " + registry.known_names();
    if (std::string_view(e.what()).find(listed) == std::string_view::npos)
      violated("the resolve error does not list the known names", name);
    for (char c : std::string_view(e.what()))
      if (static_cast<unsigned char>(c) < 0x20 || static_cast<unsigned char>(c) >= 0x7f)
        violated("the resolve error echoes a raw control or non-ASCII byte", name);
  }

  return 0;
}
