// Small argument helpers every binding shares, so the same Python object gets the same
// verdict (and error wording) whichever function it is passed to.
#pragma once
#include <pybind11/pybind11.h>

#include <string>

namespace kvroute::bindings {

/// The Python type name of obj, as error messages print it ("float", "ndarray").
inline std::string type_name(pybind11::handle obj) {
    return pybind11::str(pybind11::type::handle_of(obj).attr("__name__")).cast<std::string>();
}

/// True for bool and numpy.bool_, which the API refuses wherever it takes an int.
inline bool is_bool(pybind11::handle obj) {
    if (PyBool_Check(obj.ptr())) return true;
    // Looked up once and kept for the life of the process: a static py::object would be
    // released after the interpreter is finalized, which crashes at exit.
    static PyObject* numpy_bool =
        pybind11::object(pybind11::module_::import("numpy").attr("bool_")).release().ptr();
    return PyObject_IsInstance(obj.ptr(), numpy_bool) == 1;
}

/// True for int, float, numpy.integer and numpy.floating (bool included: callers that refuse
/// bools test is_bool first).
inline bool is_number(pybind11::handle obj) {
    if (PyLong_Check(obj.ptr()) || PyFloat_Check(obj.ptr())) return true;
    // Leaked for the same reason as numpy_bool above.
    static PyObject* numpy_numbers = [] {
        pybind11::module_ np = pybind11::module_::import("numpy");
        return pybind11::make_tuple(np.attr("integer"), np.attr("floating")).release().ptr();
    }();
    return PyObject_IsInstance(obj.ptr(), numpy_numbers) == 1;
}

/// operator.index(obj) unless obj is a bool or has no __index__ (then an empty object).
inline pybind11::object as_index(pybind11::handle obj) {
    if (PyLong_CheckExact(obj.ptr())) return pybind11::reinterpret_borrow<pybind11::object>(obj);
    if (is_bool(obj)) return pybind11::object();
    PyObject* index = PyNumber_Index(obj.ptr());
    if (index == nullptr) {
        if (PyErr_ExceptionMatches(PyExc_TypeError)) {
            PyErr_Clear();
            return pybind11::object();
        }
        throw pybind11::error_already_set();
    }
    return pybind11::reinterpret_steal<pybind11::object>(index);
}

}  // namespace kvroute::bindings
