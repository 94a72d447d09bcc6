// xxh3_64 and block_hashes; the reference twin is python/kvroute/reference/hashing.py.
#include <pybind11/numpy.h>

#include <cstdint>
#include <vector>

#include "gil.hpp"
#include "kvroute/errors.hpp"
#include "kvroute/hash.hpp"
#include "register.hpp"
#include "tokens.hpp"

namespace py = pybind11;

namespace kvroute::bindings {
namespace {

/// A buffer request released on every exit path.
struct Buffer {
    Py_buffer view{};
    bool held = false;
    ~Buffer() {
        if (held) PyBuffer_Release(&view);
    }
};

std::uint64_t check_seed(py::handle seed) {
    if (PyLong_CheckExact(seed.ptr())) {
        const unsigned long long raw = PyLong_AsUnsignedLongLong(seed.ptr());
        if (!(raw == static_cast<unsigned long long>(-1) && PyErr_Occurred())) return raw;
        PyErr_Clear();
        throw ValueError("seed must be in [0, 2**64), got " + py::str(seed).cast<std::string>());
    }
    const bool is_bool = PyBool_Check(seed.ptr()) ||
                         py::isinstance(seed, py::module_::import("numpy").attr("bool_"));
    PyObject* index = is_bool ? nullptr : PyNumber_Index(seed.ptr());
    if (index == nullptr) {
        if (!is_bool && !PyErr_ExceptionMatches(PyExc_TypeError)) throw py::error_already_set();
        PyErr_Clear();
        throw TypeError("seed must be an int, got " +
                        py::str(py::type::handle_of(seed).attr("__name__")).cast<std::string>());
    }
    py::object value = py::reinterpret_steal<py::object>(index);
    const unsigned long long raw = PyLong_AsUnsignedLongLong(value.ptr());
    if (raw == static_cast<unsigned long long>(-1) && PyErr_Occurred()) {
        // Negative or >= 2**64: OverflowError from CPython becomes the reference's ValueError.
        PyErr_Clear();
        throw ValueError("seed must be in [0, 2**64), got " + py::str(value).cast<std::string>());
    }
    return static_cast<std::uint64_t>(raw);
}

std::uint64_t hash_bytes(py::handle data, py::handle seed) {
    Buffer buffer;
    if (!PyUnicode_Check(data.ptr()) && PyObject_GetBuffer(data.ptr(), &buffer.view, PyBUF_FULL_RO) == 0) {
        buffer.held = true;
    } else {
        PyErr_Clear();
        throw TypeError("data must be a bytes-like object, got " +
                        py::str(py::type::handle_of(data).attr("__name__")).cast<std::string>());
    }
    const std::uint64_t s = check_seed(seed);
    const auto len = static_cast<std::size_t>(buffer.view.len);
    if (PyBuffer_IsContiguous(&buffer.view, 'C')) {
        return without_gil_if(len >= kGilBytes, [&] { return xxh3_64(buffer.view.buf, len, s); });
    }
    // Strided buffers hash their C-order bytes, as memoryview.tobytes() would give them.
    std::vector<unsigned char> copy(len);
    if (PyBuffer_ToContiguous(copy.data(), &buffer.view, buffer.view.len, 'C') != 0) throw py::error_already_set();
    return xxh3_64(copy.data(), len, s);
}

/// block_hashes with per-request keys: tokens are checked and narrowed first (the keyed chain
/// reads uint32), then hashed block by block with each block's items appended.
py::array_t<std::uint64_t> keyed_block_hashes(const TokenView& view, std::size_t size, const std::string& salt,
                                              const RequestKeys& keys) {
    view.check();
    std::vector<std::uint32_t> narrow;
    const std::uint32_t* data = view.data();
    if (view.wide() != nullptr) {
        narrow.resize(view.size());
        for (std::size_t i = 0; i < view.size(); ++i) narrow[i] = static_cast<std::uint32_t>(view.wide()[i]);
        data = narrow.data();
    }
    const std::size_t count = view.size() / size;
    py::array_t<std::uint64_t> out(static_cast<py::ssize_t>(count));
    const std::uint64_t root = keys.root(root_hash(salt.data(), salt.size()));
    chain_hashes_keyed(data, view.size(), size, root, 0, keys.mm.data(), keys.mm.size(), out.mutable_data());
    return out;
}

py::array_t<std::uint64_t> block_hashes(py::handle tokens, py::handle block_size, py::handle salt,
                                        py::handle lora, py::handle cache_salt, py::handle mm) {
    // Same check order as the reference, so that the first error reported is the same.
    const std::size_t size = check_block_size(block_size);
    // int32 and 64-bit tokens are range-checked inside the hashing pass below, not in a pass
    // of their own; 64-bit ones are narrowed there too, a chunk at a time.
    const TokenView view = tokens_as_uint32(tokens, /*defer_check=*/true);
    std::string salt_data;
    RequestKeys keys;
    try {
        salt_data = salt_bytes(salt);
        keys = request_keys(lora, cache_salt, mm);
    } catch (...) {
        view.check();  // a bad token outranks a bad salt or key, as in the reference
        throw;
    }
    if (!keys.lora.empty() || !keys.cache_salt.empty() || !keys.mm.empty())
        return keyed_block_hashes(view, size, salt_data, keys);
    const std::size_t count = view.size() / size;
    py::array_t<std::uint64_t> out(static_cast<py::ssize_t>(count));
    std::uint64_t* dst = out.mutable_data();
    const std::uint64_t root = root_hash(salt_data.data(), salt_data.size());
    std::uint32_t seen = 0;
    std::uint64_t seen_wide = 0;
    auto run = [&] {
        if (view.wide() != nullptr) {
            chain_hashes(view.wide(), view.size(), size, root, dst, &seen_wide);
            return;
        }
        if (!view.sign_unchecked()) {
            chain_hashes(view.data(), view.size(), size, root, dst);
            return;
        }
        chain_hashes(view.data(), view.size(), size, root, dst, &seen);
    };
    without_gil_if(view.size() >= kGilTokens, run);  // run touches no refcount
    // The top bit of an int32 token is its sign: a negative token fails the call, hashes unseen.
    if (seen >> 31) view.check();
    // A 64-bit token is in range exactly when its high half is zero (negatives included).
    if (seen_wide >> 32) view.check();
    return out;
}

}  // namespace

void register_hashing(py::module_& m) {
    m.def("xxh3_64", &hash_bytes, py::arg("data"), py::arg("seed") = 0,
          "XXH3-64 of a bytes-like object with a 64-bit seed.");
    m.def("block_hashes", &block_hashes, py::arg("tokens"), py::arg("block_size") = 16, py::kw_only(),
          py::arg("salt") = py::none(), py::arg("lora") = py::none(), py::arg("cache_salt") = py::none(),
          py::arg("mm") = py::none(),
          "Chained XXH3-64 hashes of the full blocks of `tokens`, as a uint64 array.");
}

}  // namespace kvroute::bindings
