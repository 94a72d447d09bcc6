// Argument conversion for block hashing, shared by every binding that takes tokens.
// Errors and messages match python/kvroute/reference/hashing.py exactly.
#pragma once
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "kvroute/hash.hpp"

namespace kvroute::bindings {

#if defined(__GNUC__)
#define KVROUTE_BINDING_HIDDEN __attribute__((visibility("hidden")))
#else
#define KVROUTE_BINDING_HIDDEN
#endif

/// A validated, contiguous uint32 view of a Python tokens argument; owns or pins its storage.
// Hidden like pybind11's own types, which it holds (else GCC warns about visibility).
class KVROUTE_BINDING_HIDDEN TokenView {
public:
    TokenView() = default;
    // Move-only: data_ may point into owned_, which a copy would not carry along.
    TokenView(const TokenView&) = delete;
    TokenView& operator=(const TokenView&) = delete;
    TokenView(TokenView&&) noexcept = default;
    TokenView& operator=(TokenView&&) noexcept = default;
    /// First token (valid for size() tokens while the view lives).
    const std::uint32_t* data() const noexcept { return data_; }
    /// Number of tokens.
    std::size_t size() const noexcept { return size_; }
    /// True when the tokens are int32 whose sign check was deferred (tokens_as_uint32's
    /// defer_check): a token with its top bit set is then a negative input.
    bool sign_unchecked() const noexcept { return sign_unchecked_; }
    /// With defer_check, a contiguous int64/uint64 array is not narrowed: wide() points at it
    /// in place (data() is then null) and its range is unchecked. Null otherwise.
    const std::uint64_t* wide() const noexcept { return wide_; }
    /// The deferred check: raises the reference's ValueError naming the first bad token.
    void check() const;

private:
    friend TokenView tokens_as_uint32(pybind11::handle tokens, bool defer_check);
    const std::uint32_t* data_ = nullptr;
    const std::uint64_t* wide_ = nullptr;
    std::size_t size_ = 0;
    bool sign_unchecked_ = false;
    bool wide_signed_ = false;
    pybind11::object keep_;             // the array read in place (zero-copy case)
    std::vector<std::uint32_t> owned_;  // converted tokens (list, other dtypes)
};

/// Tokens (1-D integer numpy array, list/tuple of ints, array.array) as uint32; zero-copy
/// for contiguous native-endian int32/uint32. Raises the reference's TypeError/ValueError.
/// With defer_check, int32 input is not scanned for negatives and int64/uint64 input is
/// neither narrowed nor range-checked (see wide()): the caller must run check() (or a fused
/// equivalent, as block_hashes does) before it reports any result. Needs the GIL.
TokenView tokens_as_uint32(pybind11::handle tokens, bool defer_check = false);

/// block_size as an int in [1, 65536], else the reference's TypeError/ValueError.
std::size_t check_block_size(pybind11::handle block_size);

/// The bytes a root hash is taken over: empty for None, UTF-8 for str, raw for bytes-likes.
std::string salt_bytes(pybind11::handle salt);

/// Per-request cache keys of the hash contract (C1), converted from Python arguments.
struct KVROUTE_BINDING_HIDDEN RequestKeys {
    std::string lora;                 ///< UTF-8 LoRA adapter name ("" when none)
    std::string cache_salt;           ///< UTF-8 cache salt ("" when none)
    std::vector<std::string> ids;     ///< multimodal identifiers (storage for mm)
    std::vector<MmKey> mm;            ///< items sorted by offset (stable), views into ids
    /// Root of the chain for this request, from the salt's root r0.
    std::uint64_t root(std::uint64_t r0) const { return keyed_root(r0, lora, cache_salt); }
};

/// lora / cache_salt (str or None) and mm (None or a sequence of (identifier: str, offset:
/// int >= 0, length: int >= 1)) as RequestKeys; the reference's TypeError/ValueError.
RequestKeys request_keys(pybind11::handle lora, pybind11::handle cache_salt, pybind11::handle mm);

}  // namespace kvroute::bindings
