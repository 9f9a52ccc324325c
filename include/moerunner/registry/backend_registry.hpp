// The runtime name -> policy map. Host only; no CUDA calls.
//
// Rules (README "Registering a backend"):
//  - Storage is a function-local static (global()) or a caller-owned instance, so
//    there is no static-initialization-order hazard and tests can use their own.
//  - All operations take a lock; registration may come from any thread at any time.
//  - A new name may be registered at any time; runners built later can pick it.
//  - Replacing a built-in must be spelled out (MOE_REPLACE_BUILTIN_BACKEND) and is only
//    allowed before any runner has resolved that built-in name: after that it throws,
//    so a process never runs old and new implementations side by side.
//  - Errors met during static initialization (the macros) are stored, never thrown
//    out of a static initializer, and re-raised by every later resolve().
#pragma once

#include <algorithm>
#include <mutex>
#include <optional>
#include <shared_mutex>
#include <string>
#include <string_view>
#include <vector>

#include "moerunner/core/backend_id.hpp"
#include "moerunner/core/concepts.hpp"
#include "moerunner/core/error.hpp"

namespace moerunner {

// One address per policy type, identical across translation units (inline variable).
template <class P>
inline constexpr char policy_type_key = 0;

struct registration_site {
  const char* file = "";
  int line = 0;
  std::string str() const { return std::string(file) + ":" + std::to_string(line); }
};

enum class registration_kind : unsigned char { new_backend, replace_builtin };

struct backend_record {
  backend_id id;
  const void* type_key = nullptr;
  registration_site site;
  registration_kind kind = registration_kind::new_backend;
};

class backend_registry {
 public:
  // The process-wide registry the macros fill.
  static backend_registry& global() {
    static backend_registry instance;
    return instance;
  }

  template <class P>
  void add(registration_site site, registration_kind kind) {
    static_assert(explain_dispatch_runner_core<P>());
    add_record(backend_id(std::string_view(P::name)), std::string_view(P::name), &policy_type_key<P>, site, kind);
  }

  // Static-initialization entry point of the macros: never throws, stores the error instead.
  template <class P>
  bool add_deferred(registration_site site, registration_kind kind) noexcept {
    try {
      add<P>(site, kind);
      return true;
    } catch (const std::exception& e) {
      std::unique_lock lock(mutex_);
      deferred_errors_.emplace_back(e.what());
    } catch (...) {
      std::unique_lock lock(mutex_);
      deferred_errors_.emplace_back("unknown error while registering a backend at " + site.str());
    }
    return false;
  }

  // Built-in name, else registered name, else registry_error listing the known names.
  backend_id resolve(std::string_view name) const {
    std::shared_lock lock(mutex_);
    raise_deferred_locked();
    if (is_builtin_name(name)) return backend_id(name);
    if (find_locked(name)) return backend_id(name);
    std::string msg = "unknown MoE runner backend '" + detail::echo(name) +
                      "': neither built in nor registered; known backends: " + known_names_locked();
    if (auto problem = backend_name_problem(name); !problem.empty()) msg += " (" + std::string(problem) + ")";
    throw registry_error(msg);
  }

  // The record registered under `id` (a new backend or a built-in replacement), if any.
  std::optional<backend_record> lookup(const backend_id& id) const {
    std::shared_lock lock(mutex_);
    if (const backend_record* r = find_locked(id.name())) return *r;
    return std::nullopt;
  }

  // True when some registration (new backend or replacement) was made with this policy type.
  bool has_policy_type(const void* type_key) const {
    std::shared_lock lock(mutex_);
    return std::any_of(records_.begin(), records_.end(), [&](const backend_record& r) { return r.type_key == type_key; });
  }

  // Called by a runner once it has picked `id`; freezes built-in replacement for that name.
  void note_resolved(const backend_id& id) {
    std::unique_lock lock(mutex_);
    if (id.is_builtin() && std::find(resolved_builtins_.begin(), resolved_builtins_.end(), id) == resolved_builtins_.end())
      resolved_builtins_.push_back(id);
  }

  std::vector<backend_id> registered() const {
    std::shared_lock lock(mutex_);
    std::vector<backend_id> ids;
    for (const auto& r : records_) ids.push_back(r.id);
    return ids;
  }

  std::vector<std::string> deferred_errors() const {
    std::shared_lock lock(mutex_);
    return deferred_errors_;
  }

  std::string known_names() const {
    std::shared_lock lock(mutex_);
    return known_names_locked();
  }

 private:
  void add_record(backend_id id, std::string_view raw_name, const void* key, registration_site site,
                  registration_kind kind) {
    if (auto problem = backend_name_problem(raw_name); !problem.empty())
      throw registry_error("cannot register backend '" + detail::echo(raw_name) + "' at " + site.str() + ": " +
                           std::string(problem));
    std::unique_lock lock(mutex_);
    const bool builtin = id.is_builtin();
    if (kind == registration_kind::new_backend && builtin)
      throw registry_error("cannot register backend '" + std::string(id.name()) + "' at " + site.str() +
                           ": the name is built in; to replace the built-in use MOE_REPLACE_BUILTIN_BACKEND");
    if (kind == registration_kind::replace_builtin && !builtin)
      throw registry_error("cannot replace backend '" + std::string(id.name()) + "' at " + site.str() +
                           ": no built-in has that name; built-ins are: " + builtin_names());
    if (const backend_record* prev = find_locked(id.name())) {
      // The same policy registered from the same line (a macro in a header seen by
      // several translation units) is one registration, not a duplicate.
      if (prev->type_key == key && std::string_view(prev->site.file) == site.file && prev->site.line == site.line)
        return;
      throw registry_error("duplicate registration of backend '" + std::string(id.name()) + "': first at " +
                           prev->site.str() + ", again at " + site.str());
    }
    if (kind == registration_kind::replace_builtin &&
        std::find(resolved_builtins_.begin(), resolved_builtins_.end(), id) != resolved_builtins_.end())
      throw registry_error("cannot replace built-in backend '" + std::string(id.name()) + "' at " + site.str() +
                           ": a runner has already resolved it; replace built-ins before constructing runners");
    records_.push_back({id, key, site, kind});
  }

  const backend_record* find_locked(std::string_view name) const {
    for (const auto& r : records_)
      if (r.id.name() == name) return &r;
    return nullptr;
  }

  void raise_deferred_locked() const {
    if (deferred_errors_.empty()) return;
    std::string msg = "backend registration failed during static initialization:";
    for (const auto& e : deferred_errors_) msg += "\n  " + e;
    throw registry_error(msg);
  }

  static std::string builtin_names() {
    std::string s;
    for (const auto& b : builtin::all) s += (s.empty() ? "" : ", ") + std::string(b.id.name());
    return s;
  }

  std::string known_names_locked() const {
    std::string s = builtin_names();
    for (const auto& r : records_)
      if (r.kind == registration_kind::new_backend) s += ", " + std::string(r.id.name());
    return s;
  }

  mutable std::shared_mutex mutex_;
  std::vector<backend_record> records_;
  std::vector<backend_id> resolved_builtins_;
  std::vector<std::string> deferred_errors_;
};

}  // namespace moerunner
