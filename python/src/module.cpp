// _csfmoe: the extension module. csfmoe::Error kinds become the Python
// exception classes that csfmoe/_errors.py defines (installed at import by
// _set_error_classes), carrying the C++ message unchanged.
#include <nanobind/stl/string.h>

#include <array>

#include "common.hpp"

namespace csfmoe::py {

ScaleFormat format_arg(const std::string& s) { return parse_scale_format(s); }
ScaleLayout layout_arg(const std::string& s) { return parse_scale_layout(s); }

namespace {

// One class per ErrorKind, in enum order; empty until csfmoe/__init__ sets them.
std::array<PyObject*, 6> g_error_classes{};

void set_error_classes(nb::list classes) {
  if (classes.size() != g_error_classes.size())
    throw InvalidArgument(fmt::format("_set_error_classes: expected {} classes, got {}",
                                      g_error_classes.size(), classes.size()));
  for (std::size_t i = 0; i < g_error_classes.size(); ++i) {
    nb::object c = classes[i];
    Py_XDECREF(g_error_classes[i]);
    g_error_classes[i] = c.release().ptr();  // kept for the life of the process
  }
}

void translate(const std::exception_ptr& p, void*) {
  try {
    std::rethrow_exception(p);
  } catch (const Error& e) {
    const auto k = static_cast<std::size_t>(e.kind());
    PyObject* cls = k < g_error_classes.size() ? g_error_classes[k] : nullptr;
    if (!cls) {
      // Module used without the package: fall back to the closest builtin.
      cls = e.kind() == ErrorKind::invalid_argument ? PyExc_ValueError
            : e.kind() == ErrorKind::io             ? PyExc_OSError
                                                    : PyExc_RuntimeError;
    }
    PyErr_SetString(cls, e.what());
  }
}

}  // namespace
}  // namespace csfmoe::py

NB_MODULE(_csfmoe, m) {
  using namespace csfmoe::py;
  m.doc() = "csfmoe C++ bindings (use the csfmoe package, not this module)";
  nb::register_exception_translator(translate);
  m.def("_set_error_classes", &set_error_classes);
#if defined(CSFMOE_HAVE_CUDA)
  m.attr("has_cuda") = true;
  m.attr("has_moe_cuda") = true;
#else
  m.attr("has_cuda") = false;
  m.attr("has_moe_cuda") = false;
#endif
  m.attr("has_moe") = true;
  m.attr("__version__") = CSFMOE_VERSION;  // CMake project() version
  bind_codec(m);
  bind_checkpoint(m);
  bind_moe(m);
#if defined(CSFMOE_HAVE_CUDA)
  bind_cuda(m);
  bind_moe_cuda(m);
#endif
}
