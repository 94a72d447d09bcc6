// Argument conversion for block hashes, shared by every binding that takes them.
// Errors and messages match python/kvroute/reference/index.py `as_hashes` exactly.
#pragma once
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "tokens.hpp"  // KVROUTE_BINDING_HIDDEN

namespace kvroute::bindings {

/// A validated, contiguous uint64 view of a Python hashes argument; owns or pins its storage.
// Hidden like pybind11's own types, which it holds (else GCC warns about visibility).
class KVROUTE_BINDING_HIDDEN HashView {
public:
    HashView() = default;
    /// First hash (valid for size() hashes while the view lives).
    const std::uint64_t* data() const noexcept { return data_; }
    /// Number of hashes.
    std::size_t size() const noexcept { return size_; }

private:
    friend HashView as_hashes(pybind11::handle hashes, const char* name);
    const std::uint64_t* data_ = nullptr;
    std::size_t size_ = 0;
    pybind11::object keep_;             // the array read in place (zero-copy case)
    std::vector<std::uint64_t> owned_;  // converted hashes (list, other dtypes)
};

/// Hashes (1-D integer numpy array, list/tuple of ints, array.array) as uint64; zero-copy for
/// contiguous native-endian uint64/int64. Signed values are bit-cast (two's complement), so
/// ints must be in [-2**63, 2**64). Raises the reference's TypeError/ValueError, naming the
/// argument `name`. Needs the GIL.
HashView as_hashes(pybind11::handle hashes, const char* name = "hashes");

/// One hash (an int in [-2**63, 2**64), bit-cast) or the reference's TypeError/ValueError.
std::uint64_t as_hash(pybind11::handle value, const char* name);

}  // namespace kvroute::bindings
