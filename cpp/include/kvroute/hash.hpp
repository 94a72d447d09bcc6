// XXH3-64 (written from the public xxHash specification) and kvroute's chained block hashes.
// The chain is a compatibility contract (README, "Block hashing"): tokens are uint32
// little-endian, h_root = XXH3-64(salt, seed 0), h_i = XXH3-64(block i, seed h_(i-1)).
#pragma once
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace kvroute {

/// Largest block size, in tokens, that block hashing accepts.
inline constexpr std::size_t kMaxBlockSize = 65536;

/// XXH3-64 of `len` bytes at `data` with a 64-bit seed; equals XXH3_64bits_withSeed.
std::uint64_t xxh3_64(const void* data, std::size_t len, std::uint64_t seed) noexcept;

/// Root of a hash chain: XXH3-64 of the salt bytes with seed 0 (empty salt when none).
std::uint64_t root_hash(const void* salt, std::size_t len) noexcept;

/// One multimodal item of the hash contract: its identifier and absolute token offset.
struct MmKey {
    std::string_view id;   ///< identifier bytes (UTF-8 of the str)
    std::uint64_t offset;  ///< token offset of the item's first token in the prompt
};

/// Root with per-request keys (README "Block hashing"): `r0` when both are empty, else
/// XXH3-64('L' u32le(len) lora ['C' u32le(len) cache_salt], seed=r0), each part only when
/// non-empty.
std::uint64_t keyed_root(std::uint64_t r0, std::string_view lora, std::string_view cache_salt);

/// Chained hashes of the blocks of `tokens`, whose first token sits at prompt position
/// `start_pos`; a block's payload is its token bytes followed, for every item of `items`
/// (sorted by offset, stable) whose offset lies in the block, by 'M' u32le(len id) id
/// u64le(offset). Without items it equals chain_hashes. Returns the number of blocks.
std::size_t chain_hashes_keyed(const std::uint32_t* tokens, std::size_t n_tokens, std::size_t block_size,
                               std::uint64_t seed, std::uint64_t start_pos, const MmKey* items,
                               std::size_t n_items, std::uint64_t* out);

/// Appends the contract's bytes of one item ('M' u32le(len id) id u64le(offset)) to `out`.
void append_mm_key(std::string& out, const MmKey& item);

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
