// Conversion of hashes arguments; messages mirror python/kvroute/reference/index.py
// (as_hashes, as_hash) word for word, since tests compare them.
#include "hashes.hpp"

#include <cstdint>

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

/// 'i' or 'u' for a buffer format naming one native-order integer, else 0.
char int_format_kind(const char* format) {
    if (format == nullptr) return 'u';  // no format means unsigned bytes ('B')
    if (*format == '@' || *format == '=' || (*format == '<' && PY_LITTLE_ENDIAN)) ++format;
    if (format[0] == 0 || format[1] != 0) return 0;
    switch (format[0]) {
        case 'b': case 'h': case 'i': case 'l': case 'q': case 'n': return 'i';
        case 'B': case 'H': case 'I': case 'L': case 'Q': case 'N': return 'u';
        default: return 0;
    }
}

/// True when p may be read as a uint64 in place (reading a misaligned one is undefined).
bool aligned64(const void* p) noexcept { return reinterpret_cast<std::uintptr_t>(p) % alignof(std::uint64_t) == 0; }

/// The list/tuple conversion (convert_sequence: a snapshot once an item may run Python code).
void hashes_from_sequence(py::handle hashes, const char* name, std::vector<std::uint64_t>& out) {
    convert_sequence(hashes, name, out, int_to_hash, [name](const py::object& held, std::size_t at, std::uint64_t& slot) {
        py::object index = as_index(held);
        if (!index) throw TypeError(std::string(name) + "[" + std::to_string(at) + "] must be an int, got " + type_name(held));
        if (!int_to_hash(index.ptr(), slot))
            throw ValueError("hash " + py::str(index).cast<std::string>() + " at index " + std::to_string(at) +
                             " is out of range [-2**63, 2**64)");
    });
}

}  // namespace

HashView as_hashes(py::handle hashes, const char* name) {
    HashView view;
    py::object arr_obj;
    if (py::isinstance<py::array>(hashes)) {
        refuse_masked(hashes, name);
        // The common case, a contiguous aligned uint64 or int64 array, is read in place.
        if (py::array_t<std::uint64_t, py::array::c_style>::check_(hashes) ||
            py::array_t<std::int64_t, py::array::c_style>::check_(hashes)) {
            py::array arr = py::reinterpret_borrow<py::array>(hashes);
            if (arr.ndim() != 1)
                throw ValueError(std::string(name) + " must be 1-D, got a " + std::to_string(arr.ndim()) + "-D array");
            if (aligned64(arr.data())) {
                view.data_ = static_cast<const std::uint64_t*>(arr.data());
                view.size_ = static_cast<std::size_t>(arr.shape(0));
                view.keep_ = std::move(arr);
                return view;
            }
        }
        arr_obj = py::reinterpret_borrow<py::object>(hashes);
    } else if (PyList_Check(hashes.ptr()) || PyTuple_Check(hashes.ptr())) {
        hashes_from_sequence(hashes, name, view.owned_);
        view.data_ = view.owned_.data();
        view.size_ = view.owned_.size();
        return view;
    } else {
        py::object mv = int_buffer(hashes);
        if (!mv || int_format_kind(PyMemoryView_GET_BUFFER(mv.ptr())->format) == 0) {
            // Not a plain integer buffer: an array.array says which typecode it has.
            if (is_array_array(hashes)) check_array_typecode(hashes, name);
        }
        if (!mv) {
            throw TypeError(std::string(name) +
                            " must be a 1-D integer numpy array, a list or tuple of ints, or an array.array, got " +
                            type_name(hashes));
        }
        // array.array('Q'), a memoryview of uint64...: read in place when it is one aligned run.
        const Py_buffer* buf = PyMemoryView_GET_BUFFER(mv.ptr());
        if (buf->ndim == 1 && buf->itemsize == 8 && int_format_kind(buf->format) != 0 &&
            (buf->strides == nullptr || buf->strides[0] == 8) && aligned64(buf->buf)) {
            view.data_ = static_cast<const std::uint64_t*>(buf->buf);
            view.size_ = static_cast<std::size_t>(buf->shape != nullptr ? buf->shape[0] : buf->len / 8);
            view.keep_ = std::move(mv);
            return view;
        }
        arr_obj = py::module_::import("numpy").attr("asarray")(mv);
    }
    py::array arr = py::reinterpret_borrow<py::array>(arr_obj);
    const py::dtype dtype = arr.dtype();
    const char kind = dtype.kind();
    if (kind != 'i' && kind != 'u')
        throw TypeError(std::string(name) + " must have an integer dtype, got " + py::str(dtype).cast<std::string>());
    if (arr.ndim() != 1)
        throw ValueError(std::string(name) + " must be 1-D, got a " + std::to_string(arr.ndim()) + "-D array");
    // Other widths, byte orders, strides and misaligned data: numpy's own cast into fresh
    // (aligned) memory, exactly what the reference does.
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
