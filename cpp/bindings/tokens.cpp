// Conversion of tokens, block_size and salt arguments; messages mirror
// python/kvroute/reference/hashing.py word for word, since tests compare them.
#include "tokens.hpp"

#include <algorithm>
#include <climits>
#include <cstring>
#include <string_view>

#include "kvroute/errors.hpp"
#include "kvroute/hash.hpp"
#include "pyargs.hpp"

namespace py = pybind11;

namespace kvroute::bindings {
namespace {

/// The int's value when it lies in [lo, hi], else false; `index` must be a Python int.
bool int_in_range(py::handle index, long long lo, long long hi, long long& value) {
    int overflow = 0;
    value = PyLong_AsLongLongAndOverflow(index.ptr(), &overflow);
    if (value == -1 && PyErr_Occurred()) throw py::error_already_set();
    return overflow == 0 && value >= lo && value <= hi;
}

[[noreturn]] void bad_token(const std::string& value, std::size_t i) {
    throw ValueError("token " + value + " at index " + std::to_string(i) + " is out of range [0, 2**32)");
}

template <class T>
[[noreturn]] void bad_token_at(const T* data, std::size_t n, bool (*bad)(T)) {
    for (std::size_t i = 0; i < n; ++i) {
        if (bad(data[i])) bad_token(std::to_string(data[i]), i);
    }
    throw StateError("token range check disagreed with itself");
}

/// OR of all values; 16 independent lanes keep it at load throughput (GCC 12 compiles the
/// one-accumulator loop five times slower).
std::int32_t or_reduce(const std::int32_t* p, std::size_t n) noexcept {
    std::int32_t lanes[16] = {};
    std::size_t i = 0;
    for (; i + 16 <= n; i += 16) {
        for (std::size_t k = 0; k < 16; ++k) lanes[k] |= p[i + k];
    }
    std::int32_t any = 0;
    for (; i < n; ++i) any |= p[i];
    for (std::int32_t lane : lanes) any |= lane;
    return any;
}

/// Narrows to uint32, flagging values outside [0, 2**32) in one branch-free pass.
template <class T>
void narrow_tokens(const T* src, std::size_t n, std::vector<std::uint32_t>& out) {
    out.resize(n);
    std::uint64_t high = 0;
    for (std::size_t i = 0; i < n; ++i) {
        const auto wide = static_cast<std::uint64_t>(static_cast<std::int64_t>(src[i]));
        high |= wide;
        out[i] = static_cast<std::uint32_t>(wide);
    }
    if (high >> 32 != 0) {
        bad_token_at<T>(src, n, [](T v) {
            return static_cast<std::uint64_t>(static_cast<std::int64_t>(v)) >> 32 != 0;
        });
    }
}

template <>
void narrow_tokens<std::uint64_t>(const std::uint64_t* src, std::size_t n, std::vector<std::uint32_t>& out) {
    out.resize(n);
    std::uint64_t high = 0;
    for (std::size_t i = 0; i < n; ++i) {
        high |= src[i];
        out[i] = static_cast<std::uint32_t>(src[i]);
    }
    if (high >> 32 != 0) bad_token_at<std::uint64_t>(src, n, [](std::uint64_t v) { return v >> 32 != 0; });
}

}  // namespace

void TokenView::check() const {
    if (sign_unchecked_) {
        const auto* p = reinterpret_cast<const std::int32_t*>(data_);
        if (or_reduce(p, size_) < 0) bad_token_at<std::int32_t>(p, size_, [](std::int32_t v) { return v < 0; });
    }
    if (wide_ != nullptr) {
        std::vector<std::uint32_t> scratch;
        if (wide_signed_) {
            narrow_tokens(reinterpret_cast<const std::int64_t*>(wide_), size_, scratch);
        } else {
            narrow_tokens(wide_, size_, scratch);
        }
    }
}

namespace {

/// A plain int token read in place; false (for the slow path's message) when out of range.
bool token_from_int(PyObject* item, std::uint32_t& slot) {
    int overflow = 0;
    const long long value = PyLong_AsLongLongAndOverflow(item, &overflow);
    if (overflow != 0 || value < 0 || value > 0xFFFFFFFFLL) return false;
    slot = static_cast<std::uint32_t>(value);
    return true;
}

/// Any other item: bools refused, numpy integers and other __index__ types converted.
void token_from_object(const py::object& held, std::size_t at, std::uint32_t& slot) {
    py::object index;
    if (PyLong_CheckExact(held.ptr())) {
        index = held;
    } else {
        if (!is_bool(held)) index = as_index(held);
        if (!index) throw TypeError("tokens[" + std::to_string(at) + "] must be an int, got " + type_name(held));
    }
    long long value = 0;
    if (!int_in_range(index, 0, 0xFFFFFFFFLL, value)) bad_token(py::str(index).cast<std::string>(), at);
    slot = static_cast<std::uint32_t>(value);
}

/// The list/tuple conversion into out (convert_sequence: a snapshot once an item may run
/// Python code).
void tokens_from_sequence(py::handle tokens, std::vector<std::uint32_t>& out) {
    convert_sequence(tokens, "tokens", out, token_from_int, token_from_object);
}

}  // namespace

TokenView tokens_as_uint32(py::handle tokens, bool defer_check) {
    TokenView view;
    py::object arr_obj;
    if (py::isinstance<py::array>(tokens)) {
        refuse_masked(tokens, "tokens");
        arr_obj = py::reinterpret_borrow<py::object>(tokens);
    } else if (PyList_Check(tokens.ptr()) || PyTuple_Check(tokens.ptr())) {
        tokens_from_sequence(tokens, view.owned_);
        view.data_ = view.owned_.data();
        view.size_ = view.owned_.size();
        return view;
    } else {
        if (is_array_array(tokens)) check_array_typecode(tokens, "tokens");
        py::object mv = int_buffer(tokens);  // array.array, memoryview: numpy reads the format
        if (!mv) {
            throw TypeError(
                "tokens must be a 1-D integer numpy array, a list or tuple of ints, or an array.array, got " +
                type_name(tokens));
        }
        arr_obj = py::module_::import("numpy").attr("asarray")(mv);
    }

    py::array arr = py::reinterpret_borrow<py::array>(arr_obj);
    const py::dtype dtype = arr.dtype();
    const char kind = dtype.kind();
    if (kind != 'i' && kind != 'u') {
        throw TypeError("tokens must have an integer dtype, got " + py::str(dtype).cast<std::string>());
    }
    if (arr.ndim() != 1) {
        throw ValueError("tokens must be 1-D, got a " + std::to_string(arr.ndim()) + "-D array");
    }
    const char order = dtype.byteorder();
    const bool native_order = order == '=' || order == '|' || (order == '<') == (PY_BIG_ENDIAN == 0);
    const bool aligned = reinterpret_cast<std::uintptr_t>(arr.data()) % static_cast<std::uintptr_t>(dtype.itemsize()) == 0;
    if (!native_order || !(arr.flags() & py::array::c_style) || !aligned) {
        // Rare inputs (strided, byte-swapped, misaligned: reading those in place is undefined
        // behaviour) get one numpy copy into fresh memory in the common layout.
        arr = py::module_::import("numpy").attr("array")(
            arr, py::arg("dtype") = dtype.attr("newbyteorder")("="), py::arg("order") = "C", py::arg("copy") = true);
    }
    const auto n = static_cast<std::size_t>(arr.shape(0));
    const void* ptr = arr.data();
    switch ((kind == 'i' ? 0 : 16) + dtype.itemsize()) {
        case 4: {
            // int32 is read in place: one OR-reduction finds any negative token.
            const auto* p = static_cast<const std::int32_t*>(ptr);
            view.sign_unchecked_ = defer_check;
            if (!defer_check && or_reduce(p, n) < 0) bad_token_at<std::int32_t>(p, n, [](std::int32_t v) { return v < 0; });
            view.data_ = reinterpret_cast<const std::uint32_t*>(p);
            view.size_ = n;
            view.keep_ = std::move(arr);
            return view;
        }
        case 16 + 4:
            view.data_ = static_cast<const std::uint32_t*>(ptr);
            view.size_ = n;
            view.keep_ = std::move(arr);
            return view;
        case 8:
        case 16 + 8:
            if (defer_check) {
                // Read in place; block_hashes range-checks inside its hashing pass.
                view.wide_ = static_cast<const std::uint64_t*>(ptr);
                view.wide_signed_ = kind == 'i';
                view.size_ = n;
                view.keep_ = std::move(arr);
                return view;
            }
            if (kind == 'i') {
                narrow_tokens(static_cast<const std::int64_t*>(ptr), n, view.owned_);
            } else {
                narrow_tokens(static_cast<const std::uint64_t*>(ptr), n, view.owned_);
            }
            break;
        case 1: narrow_tokens(static_cast<const std::int8_t*>(ptr), n, view.owned_); break;
        case 2: narrow_tokens(static_cast<const std::int16_t*>(ptr), n, view.owned_); break;
        case 16 + 1: narrow_tokens(static_cast<const std::uint8_t*>(ptr), n, view.owned_); break;
        case 16 + 2: narrow_tokens(static_cast<const std::uint16_t*>(ptr), n, view.owned_); break;
        default:
            throw TypeError("tokens must have an integer dtype, got " + py::str(dtype).cast<std::string>());
    }
    view.data_ = view.owned_.data();
    view.size_ = n;
    return view;
}

std::size_t check_block_size(py::handle block_size) {
    py::object index;
    if (PyLong_CheckExact(block_size.ptr())) {
        index = py::reinterpret_borrow<py::object>(block_size);
    } else if (!is_bool(block_size)) {
        index = as_index(block_size);
    }
    if (!index) throw TypeError("block_size must be an int, got " + type_name(block_size));
    long long value = 0;
    if (!int_in_range(index, 1, static_cast<long long>(kMaxBlockSize), value)) {
        throw ValueError("block_size must be in [1, " + std::to_string(kMaxBlockSize) + "], got " +
                         py::str(index).cast<std::string>());
    }
    return static_cast<std::size_t>(value);
}

std::string salt_bytes(py::handle salt) {
    if (salt.is_none()) return std::string();
    if (PyUnicode_Check(salt.ptr())) {
        return utf8_arg(salt, "salt");
    }
    if (PyBytes_Check(salt.ptr()) || PyByteArray_Check(salt.ptr()) || PyMemoryView_Check(salt.ptr())) {
        PyObject* raw = PyBytes_FromObject(salt.ptr());
        if (raw == nullptr) throw py::error_already_set();
        return py::reinterpret_steal<py::bytes>(raw).cast<std::string>();
    }
    throw TypeError("salt must be str, bytes or None, got " + type_name(salt));
}

namespace {

std::string utf8_or_none(py::handle value, const char* name) {
    if (value.is_none()) return std::string();
    if (!PyUnicode_Check(value.ptr()))
        throw TypeError(std::string(name) + " must be a str or None, got " + type_name(value));
    return utf8_arg(value, name);
}

std::uint64_t mm_int(py::handle value, std::size_t i, const char* what, long long lo) {
    const py::object index = as_index(value);
    const std::string where = "mm[" + std::to_string(i) + "] " + what;
    if (!index) throw TypeError(where + " must be an int, got " + type_name(value));
    long long v = 0;
    if (!int_in_range(index, lo, LLONG_MAX, v))
        throw ValueError(where + " must be in [" + std::to_string(lo) + ", 2**63), got " +
                         py::str(index).cast<std::string>());
    return static_cast<std::uint64_t>(v);
}

}  // namespace

RequestKeys request_keys(py::handle lora, py::handle cache_salt, py::handle mm) {
    RequestKeys keys;
    keys.lora = utf8_or_none(lora, "lora");
    keys.cache_salt = utf8_or_none(cache_salt, "cache_salt");
    if (mm.is_none()) return keys;
    if (!PyList_Check(mm.ptr()) && !PyTuple_Check(mm.ptr()))
        throw TypeError("mm must be a list or tuple of (identifier, offset, length), got " + type_name(mm));
    // A copy first: a list that changes while it is read must not be read half-changed.
    const py::tuple items = py::reinterpret_steal<py::tuple>(PySequence_Tuple(mm.ptr()));
    if (!items) throw py::error_already_set();
    std::vector<std::uint64_t> offsets;
    for (std::size_t i = 0; i < items.size(); ++i) {
        const py::handle item = items[i];
        if ((!PyList_Check(item.ptr()) && !PyTuple_Check(item.ptr())) || py::len(item) != 3)
            throw TypeError("mm[" + std::to_string(i) + "] must be an (identifier, offset, length) tuple, got " +
                            type_name(item));
        const py::tuple fields = py::reinterpret_steal<py::tuple>(PySequence_Tuple(item.ptr()));
        if (!fields) throw py::error_already_set();
        if (!PyUnicode_Check(fields[0].ptr()))
            throw TypeError("mm[" + std::to_string(i) + "] identifier must be a str, got " + type_name(fields[0]));
        std::string id = utf8_arg(fields[0], ("mm[" + std::to_string(i) + "] identifier").c_str());
        offsets.push_back(mm_int(fields[1], i, "offset", 0));
        mm_int(fields[2], i, "length", 1);
        keys.ids.push_back(std::move(id));
    }
    // Views are taken once every string is in place (a growing vector moves short strings).
    for (std::size_t i = 0; i < keys.ids.size(); ++i) keys.mm.push_back(MmKey{keys.ids[i], offsets[i]});
    std::stable_sort(keys.mm.begin(), keys.mm.end(),
                     [](const MmKey& a, const MmKey& b) { return a.offset < b.offset; });
    return keys;
}

}  // namespace kvroute::bindings
