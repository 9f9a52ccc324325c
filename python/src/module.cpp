// The extension module moerunner._moerunner: the library's exceptions as Python exceptions,
// the runner, routing and what this build holds. The Python package on top adds defaults
// (output and workspace allocation, streams) and the torch op.
#include <exception>

#include <nanobind/nanobind.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "bindings.hpp"
#include "runner_set.hpp"

namespace nb = nanobind;

namespace {

// The Python classes of moerunner._errors, one per moe_error subclass (see that file). Their
// references are kept for the life of the process: the translator may run until the end.
struct error_types {
  PyObject *base, *invalid_argument, *registry, *unsupported, *cuda;
};

void translate(const std::exception_ptr& p, void* payload) {
  const auto& t = *static_cast<const error_types*>(payload);
  try {
    std::rethrow_exception(p);
  } catch (const moerunner::invalid_argument_error& e) {
    PyErr_SetString(t.invalid_argument, e.what());
  } catch (const moerunner::registry_error& e) {
    PyErr_SetString(t.registry, e.what());
  } catch (const moerunner::unsupported_error& e) {
    PyErr_SetString(t.unsupported, e.what());
  } catch (const moerunner::cuda_error& e) {
    PyErr_SetString(t.cuda, e.what());
  } catch (const moerunner::moe_error& e) {
    PyErr_SetString(t.base, e.what());
  }
}

}  // namespace

NB_MODULE(_moerunner, m) {
  const nb::module_ errors = nb::module_::import_("moerunner._errors");
  auto keep = [&](const char* name) { return nb::object(errors.attr(name)).release().ptr(); };
  static error_types types{keep("MoeError"), keep("InvalidArgumentError"), keep("RegistryError"),
                           keep("UnsupportedError"), keep("CudaError")};
  nb::register_exception_translator(translate, &types);

  m.attr("__version__") = MOERUNNER_VERSION;
  m.def("backends", &moerunner::python::runner_backends,
        "The backends this build can run, built-in ones first, in the library's order.");
  moerunner::python::bind_runner(m);
  moerunner::python::bind_topk(m);
}
