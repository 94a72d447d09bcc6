// The 64-bit finalizer every kvroute hash table spreads its keys with.
#pragma once
#include <cstdint>

namespace kvroute::support {

/// MurmurHash3's fmix64: callers (and tests) use small or sequential ids as hashes, so keys
/// are spread before range reduction.
inline std::uint64_t mix64(std::uint64_t x) noexcept {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ULL;
    x ^= x >> 33;
    return x;
}

}  // namespace kvroute::support
