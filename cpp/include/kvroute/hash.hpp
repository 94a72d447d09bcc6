// XXH3-64 (written from the public xxHash specification) and kvroute's chained block hashes.
// The chain is a compatibility contract (README, "Block hashing"): tokens are uint32
// little-endian, h_root = XXH3-64(salt, seed 0), h_i = XXH3-64(block i, seed h_(i-1)).
#pragma once
#include <cstddef>
#include <cstdint>

namespace kvroute {

/// Largest block size, in tokens, that block hashing accepts.
inline constexpr std::size_t kMaxBlockSize = 65536;

/// XXH3-64 of `len` bytes at `data` with a 64-bit seed; equals XXH3_64bits_withSeed.
std::uint64_t xxh3_64(const void* data, std::size_t len, std::uint64_t seed) noexcept;

/// Root of a hash chain: XXH3-64 of the salt bytes with seed 0 (empty salt when none).
std::uint64_t root_hash(const void* salt, std::size_t len) noexcept;

/// Writes n_tokens / block_size chained hashes to out (each block's hash seeds the next,
/// the first is seeded with `seed`) and returns how many; block_size must be >= 1.
std::size_t chain_hashes(const std::uint32_t* tokens, std::size_t n_tokens, std::size_t block_size,
                         std::uint64_t seed, std::uint64_t* out) noexcept;

/// chain_hashes that also stores in *seen the bitwise OR of all n_tokens tokens (the unhashed
/// tail too), so that a caller can range-check signed input in the same pass over memory.
std::size_t chain_hashes(const std::uint32_t* tokens, std::size_t n_tokens, std::size_t block_size,
                         std::uint64_t seed, std::uint64_t* out, std::uint32_t* seen) noexcept;

/// chain_hashes over tokens held as 64-bit integers (int64/uint64 arrays, read in place):
/// hashes each value's low 32 bits and stores in *seen the OR of all n_tokens values, so that
/// the caller rejects values outside [0, 2**32) from `*seen >> 32` without a pass of its own.
std::size_t chain_hashes(const std::uint64_t* tokens, std::size_t n_tokens, std::size_t block_size,
                         std::uint64_t seed, std::uint64_t* out, std::uint64_t* seen);

}  // namespace kvroute
