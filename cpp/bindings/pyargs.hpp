// Small argument helpers every binding shares, so the same Python object gets the same
// verdict (and error wording) whichever function it is passed to.
#pragma once
#include <pybind11/pybind11.h>

#include <string>
#include <vector>

#include "kvroute/errors.hpp"

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

/// A str argument as UTF-8, or ValueError "<what> must be encodable as UTF-8, got a lone
/// surrogate at index i": UTF-8 cannot encode a lone surrogate (json.loads makes one from
/// "\\ud800"), and a name, session or medium is a key both implementations must agree on byte
/// for byte, so it is refused rather than given an invented encoding. Mirror:
/// python/kvroute/reference/args.py utf8_bytes/check_text. obj must be a str.
inline std::string utf8_arg(pybind11::handle obj, const char* what) {
    Py_ssize_t size = 0;
    const char* data = PyUnicode_AsUTF8AndSize(obj.ptr(), &size);
    if (data != nullptr) return std::string(data, static_cast<std::size_t>(size));
    if (!PyErr_ExceptionMatches(PyExc_UnicodeEncodeError)) throw pybind11::error_already_set();
    PyErr_Clear();
    const Py_ssize_t n = PyUnicode_GET_LENGTH(obj.ptr());
    Py_ssize_t i = 0;
    while (i < n && !Py_UNICODE_IS_SURROGATE(PyUnicode_READ_CHAR(obj.ptr(), i))) ++i;
    throw ValueError(std::string(what) + " must be encodable as UTF-8, got a lone surrogate at index " +
                     std::to_string(i));
}

/// TypeError for a numpy masked array (its mask would be silently ignored); mirror of the
/// reference's args.refuse_masked. Cheap for a plain ndarray (an exact type test).
inline void refuse_masked(pybind11::handle arr, const std::string& name) {
    static PyObject* ndarray =
        pybind11::object(pybind11::module_::import("numpy").attr("ndarray")).release().ptr();
    if (Py_TYPE(arr.ptr()) == reinterpret_cast<PyTypeObject*>(ndarray)) return;
    // Leaked like numpy_bool above: a static py::object would be released after finalization.
    static PyObject* masked =
        pybind11::object(pybind11::module_::import("numpy.ma").attr("MaskedArray")).release().ptr();
    const int is_masked = PyObject_IsInstance(arr.ptr(), masked);
    if (is_masked < 0) throw pybind11::error_already_set();
    if (is_masked == 1) {
        throw TypeError(name +
                        " must not be a numpy masked array (its mask cannot be honoured); "
                        "pass .compressed() or .filled(value)");
    }
}

/// True for an array.array (the type is looked up once).
inline bool is_array_array(pybind11::handle obj) {
    static PyObject* array_type =
        pybind11::object(pybind11::module_::import("array").attr("array")).release().ptr();
    return PyObject_IsInstance(obj.ptr(), array_type) == 1;
}

/// TypeError "<name> must have an integer dtype, got array.array of typecode 'd'" unless the
/// array.array obj holds integers.
inline void check_array_typecode(pybind11::handle obj, const std::string& name) {
    pybind11::object typecode = obj.attr("typecode");
    const std::string code = typecode.cast<std::string>();
    if (code.size() != 1 || std::string("bBhHiIlLqQ").find(code[0]) == std::string::npos) {
        throw TypeError(name + " must have an integer dtype, got array.array of typecode " +
                        pybind11::repr(typecode).cast<std::string>());
    }
}

/// A memoryview of obj when obj exports a buffer of at least one dimension and is not a str,
/// bytes, bytearray or numpy scalar (raw bytes where integers belong are refused as before);
/// else an empty object. Mirror of the reference's args.int_buffer. The memoryview holds the
/// export, so an array.array cannot be resized while it is read.
inline pybind11::object int_buffer(pybind11::handle obj) {
    PyObject* p = obj.ptr();
    if (!PyObject_CheckBuffer(p) || PyUnicode_Check(p) || PyBytes_Check(p) || PyByteArray_Check(p))
        return pybind11::object();
    PyObject* view = PyMemoryView_FromObject(p);
    if (view == nullptr) throw pybind11::error_already_set();
    auto held = pybind11::reinterpret_steal<pybind11::object>(view);
    // A numpy scalar exports a 0-D buffer: one value, not an array.
    if (PyMemoryView_GET_BUFFER(view)->ndim == 0) return pybind11::object();
    return held;
}

/// Converts a list or tuple item by item into out. `fast(item, slot)` reads a plain int in
/// place and returns false for anything it does not take; every other item goes to
/// `slow(held, at, slot)`, which may run Python code (__index__) and so may resize a list:
/// from the first such item on, a snapshot taken at that point (equal to the sequence as
/// passed) is read instead, as the reference reads tuple(seq). `name` names the argument.
template <class T, class Fast, class Slow>
void convert_sequence(pybind11::handle obj, const char* name, std::vector<T>& out, Fast fast, Slow slow) {
    auto seq = pybind11::reinterpret_borrow<pybind11::object>(obj);
    const Py_ssize_t n = PySequence_Fast_GET_SIZE(seq.ptr());
    out.resize(static_cast<std::size_t>(n));
    bool snapshot = PyTuple_Check(seq.ptr());
    for (Py_ssize_t i = 0; i < n; ++i) {
        // Only a finalizer run by a collection could resize the list here; never read past it.
        if (PySequence_Fast_GET_SIZE(seq.ptr()) != n)
            throw StateError(std::string(name) + " changed size during conversion");
        PyObject* item = PySequence_Fast_GET_ITEM(seq.ptr(), i);
        const auto at = static_cast<std::size_t>(i);
        if (PyLong_CheckExact(item) && fast(item, out[at])) continue;
        if (!snapshot) {
            seq = pybind11::reinterpret_steal<pybind11::object>(PySequence_Tuple(seq.ptr()));
            if (!seq) throw pybind11::error_already_set();
            snapshot = true;
            item = PyTuple_GET_ITEM(seq.ptr(), i);
        }
        slow(pybind11::reinterpret_borrow<pybind11::object>(item), at, out[at]);
    }
}

}  // namespace kvroute::bindings
