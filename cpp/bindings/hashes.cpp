// Conversion of hashes arguments; messages mirror python/kvroute/reference/index.py
// (as_hashes, as_hash) word for word, since tests compare them.
#include "hashes.hpp"

#include <string_view>

#include "kvroute/errors.hpp"
#include "pyargs.hpp"

namespace py = pybind11;

namespace kvroute::bindings {
namespace {

/// The value of a Python int in [-2**63, 2**64), bit-cast to uint64; false if outside.
bool int_to_hash(PyObject* index, std::uint64_t& out) {
    const unsigned long long u = PyLong_AsUnsignedLongLong(index);
    if (!(u == static_cast<unsigned long long>(-1) && PyErr_Occurred())) {
        out = u;
        return true;
    }
    PyErr_Clear();
    int overflow = 0;
    const long long s = PyLong_AsLongLongAndOverflow(index, &overflow);
    if (s == -1 && PyErr_Occurred()) throw py::error_already_set();
    if (overflow != 0) return false;
    out = static_cast<std::uint64_t>(s);
    return true;
}

}  // namespace

HashView as_hashes(py::handle hashes, const char* name) {
    HashView view;
    // The common case, a contiguous uint64 or int64 array, is read in place.
    if (py::array_t<std::uint64_t, py::array::c_style>::check_(hashes) ||
        py::array_t<std::int64_t, py::array::c_style>::check_(hashes)) {
        py::array arr = py::reinterpret_borrow<py::array>(hashes);
        if (arr.ndim() != 1)
            throw ValueError(std::string(name) + " must be 1-D, got a " + std::to_string(arr.ndim()) + "-D array");
        view.data_ = static_cast<const std::uint64_t*>(arr.data());
        view.size_ = static_cast<std::size_t>(arr.shape(0));
        view.keep_ = std::move(arr);
        return view;
    }
    py::object arr_obj;
    if (py::isinstance<py::array>(hashes)) {
        arr_obj = py::reinterpret_borrow<py::object>(hashes);
    } else if (py::isinstance(hashes, py::module_::import("array").attr("array"))) {
        py::object typecode = hashes.attr("typecode");
        const std::string code = typecode.cast<std::string>();
        if (code.size() != 1 || std::string_view("bBhHiIlLqQ").find(code[0]) == std::string_view::npos) {
            throw TypeError(std::string(name) + " must have an integer dtype, got array.array of typecode " +
                            py::repr(typecode).cast<std::string>());
        }
        py::module_ np = py::module_::import("numpy");
        arr_obj = np.attr("frombuffer")(hashes, py::arg("dtype") = np.attr("dtype")(typecode));
    } else if (PyList_Check(hashes.ptr()) || PyTuple_Check(hashes.ptr())) {
        py::sequence seq = py::reinterpret_borrow<py::sequence>(hashes);
        const std::size_t n = seq.size();
        view.owned_.resize(n);
        for (std::size_t i = 0; i < n; ++i) {
            py::object item = seq[i];
            py::object index = as_index(item);
            if (!index)
                throw TypeError(std::string(name) + "[" + std::to_string(i) + "] must be an int, got " + type_name(item));
            if (!int_to_hash(index.ptr(), view.owned_[i]))
                throw ValueError("hash " + py::str(index).cast<std::string>() + " at index " + std::to_string(i) +
                                 " is out of range [-2**63, 2**64)");
        }
        view.data_ = view.owned_.data();
        view.size_ = n;
        return view;
    } else {
        throw TypeError(std::string(name) +
                        " must be a 1-D integer numpy array, a list or tuple of ints, or an array.array, got " +
                        type_name(hashes));
    }
    py::array arr = py::reinterpret_borrow<py::array>(arr_obj);
    const py::dtype dtype = arr.dtype();
    const char kind = dtype.kind();
    if (kind != 'i' && kind != 'u')
        throw TypeError(std::string(name) + " must have an integer dtype, got " + py::str(dtype).cast<std::string>());
    if (arr.ndim() != 1)
        throw ValueError(std::string(name) + " must be 1-D, got a " + std::to_string(arr.ndim()) + "-D array");
    // Other widths, byte orders and strides: numpy's own cast, exactly what the reference does.
    py::module_ np = py::module_::import("numpy");
    py::array conv = np.attr("ascontiguousarray")(arr.attr("astype")(np.attr("uint64")));
    view.data_ = static_cast<const std::uint64_t*>(conv.data());
    view.size_ = static_cast<std::size_t>(conv.shape(0));
    view.keep_ = std::move(conv);
    return view;
}

std::uint64_t as_hash(py::handle value, const char* name) {
    py::object index = as_index(value);
    if (!index) throw TypeError(std::string(name) + " must be an int, got " + type_name(value));
    std::uint64_t out = 0;
    if (!int_to_hash(index.ptr(), out))
        throw ValueError(std::string(name) + " " + py::str(index).cast<std::string>() +
                         " is out of range [-2**63, 2**64)");
    return out;
}

}  // namespace kvroute::bindings
