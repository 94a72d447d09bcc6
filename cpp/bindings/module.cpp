// kvroute._native: the compiled twin of kvroute.reference. Each concept registers itself.
#include "kvroute/errors.hpp"
#include "kvroute/version.hpp"
#include "gil.hpp"
#include "pyargs.hpp"
#include "register.hpp"

namespace py = pybind11;

PYBIND11_MODULE(_native, m) {
    m.doc() = "kvroute's C++ core; kvroute.reference is its pure-Python twin.";
    m.attr("__version__") = kvroute::version();

    // The core's typed errors become the Python exceptions the reference twin raises.
    py::register_exception_translator([](std::exception_ptr p) {
        try {
            if (p) std::rethrow_exception(p);
        } catch (const kvroute::TypeError& e) {
            PyErr_SetString(PyExc_TypeError, e.what());
        } catch (const kvroute::ValueError& e) {
            PyErr_SetString(PyExc_ValueError, e.what());
        } catch (const kvroute::IndexError& e) {
            PyErr_SetString(PyExc_IndexError, e.what());
        } catch (const kvroute::KeyError& e) {
            // KeyError(str) would repr() the message with quotes; the reference raises KeyError(msg) too.
            py::object err = py::reinterpret_steal<py::object>(PyUnicode_FromString(e.what()));
            PyErr_SetObject(PyExc_KeyError, err.ptr());
        } catch (const kvroute::StateError& e) {
            PyErr_SetString(PyExc_RuntimeError, e.what());
        }
    });

    kvroute::bindings::register_hashing(m);
    kvroute::bindings::register_index(m);
    kvroute::bindings::register_router(m);
    kvroute::bindings::register_events(m);

    m.def(
        "_release_gil_always",
        [](py::handle on) {
            if (!kvroute::bindings::is_bool(on))
                throw kvroute::TypeError("on must be a bool, got " + kvroute::bindings::type_name(on));
            kvroute::bindings::release_gil_always.store(PyObject_IsTrue(on.ptr()) == 1, std::memory_order_relaxed);
        },
        py::arg("on"),
        "Testing only: every call releases the GIL whatever its size (gil.hpp), so that threaded tests run "
        "native code in several threads at once for ThreadSanitizer to check. The reference's twin checks "
        "`on` and changes nothing.");
}
