// XXH3-64, written from the public specification (doc/xxhash_spec.md of Cyan4973/xxHash),
// and kvroute's chained block hashes on top of it.
#include "kvroute/hash.hpp"

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace kvroute {
namespace {

using u8 = std::uint8_t;
using u32 = std::uint32_t;
using u64 = std::uint64_t;

constexpr u64 kPrime32_1 = 0x9E3779B1U;
constexpr u64 kPrime32_2 = 0x85EBCA77U;
constexpr u64 kPrime32_3 = 0xC2B2AE3DU;
constexpr u64 kPrime64_1 = 0x9E3779B185EBCA87ULL;
constexpr u64 kPrime64_2 = 0xC2B2AE3D27D4EB4FULL;
constexpr u64 kPrime64_3 = 0x165667B19E3779F9ULL;
constexpr u64 kPrime64_4 = 0x85EBCA77C2B2AE63ULL;
constexpr u64 kPrime64_5 = 0x27D4EB2F165667C5ULL;
constexpr u64 kPrimeMx1 = 0x165667919E3779F9ULL;
constexpr u64 kPrimeMx2 = 0x9FB21C651E98DF25ULL;

constexpr std::size_t kSecretSize = 192;
constexpr std::size_t kStripeLen = 64;
constexpr std::size_t kStripesPerBlock = (kSecretSize - kStripeLen) / 8;
constexpr std::size_t kBlockLen = kStripeLen * kStripesPerBlock;

alignas(64) constexpr u8 kDefaultSecret[kSecretSize] = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
};

#if defined(__BYTE_ORDER__) && defined(__ORDER_BIG_ENDIAN__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
constexpr bool kLittleEndian = false;
#else
constexpr bool kLittleEndian = true;
#endif

inline u32 bswap32(u32 x) noexcept {
#if defined(__GNUC__)
    return __builtin_bswap32(x);
#else
    return ((x << 24) & 0xff000000U) | ((x << 8) & 0x00ff0000U) | ((x >> 8) & 0x0000ff00U) |
           ((x >> 24) & 0x000000ffU);
#endif
}

inline u64 bswap64(u64 x) noexcept {
#if defined(__GNUC__)
    return __builtin_bswap64(x);
#else
    return (static_cast<u64>(bswap32(static_cast<u32>(x))) << 32) | bswap32(static_cast<u32>(x >> 32));
#endif
}

// The spec reads every input and secret word little-endian, whatever the host.
inline u32 read32(const u8* p) noexcept {
    u32 v;
    std::memcpy(&v, p, sizeof v);
    return kLittleEndian ? v : bswap32(v);
}

inline u64 read64(const u8* p) noexcept {
    u64 v;
    std::memcpy(&v, p, sizeof v);
    return kLittleEndian ? v : bswap64(v);
}

inline void write64(u8* p, u64 v) noexcept {
    if (!kLittleEndian) v = bswap64(v);
    std::memcpy(p, &v, sizeof v);
}

inline u64 rotl64(u64 x, unsigned r) noexcept { return (x << r) | (x >> (64U - r)); }

/// Full 64x64 -> 128 product folded to 64 bits (low xor high).
inline u64 mul128_fold64(u64 a, u64 b) noexcept {
#if defined(__SIZEOF_INT128__)
    __extension__ using u128 = unsigned __int128;
    const u128 product = static_cast<u128>(a) * b;
    return static_cast<u64>(product) ^ static_cast<u64>(product >> 64);
#else
    // Schoolbook product of 32-bit halves, for compilers without a 128-bit integer.
    const u64 lo_lo = (a & 0xFFFFFFFFU) * (b & 0xFFFFFFFFU);
    const u64 hi_lo = (a >> 32) * (b & 0xFFFFFFFFU);
    const u64 lo_hi = (a & 0xFFFFFFFFU) * (b >> 32);
    const u64 hi_hi = (a >> 32) * (b >> 32);
    const u64 cross = (lo_lo >> 32) + (hi_lo & 0xFFFFFFFFU) + lo_hi;
    const u64 upper = (hi_lo >> 32) + (cross >> 32) + hi_hi;
    const u64 lower = (cross << 32) | (lo_lo & 0xFFFFFFFFU);
    return lower ^ upper;
#endif
}

inline u64 avalanche_xxh64(u64 x) noexcept {
    x ^= x >> 33;
    x *= kPrime64_2;
    x ^= x >> 29;
    x *= kPrime64_3;
    x ^= x >> 32;
    return x;
}

inline u64 avalanche(u64 x) noexcept {
    x ^= x >> 37;
    x *= kPrimeMx1;
    x ^= x >> 32;
    return x;
}

inline u64 mix_step(const u8* data, const u8* secret, u64 seed) noexcept {
    return mul128_fold64(read64(data) ^ (read64(secret) + seed),
                         read64(data + 8) ^ (read64(secret + 8) - seed));
}

u64 hash_0to16(const u8* p, std::size_t len, u64 seed) noexcept {
    const u8* s = kDefaultSecret;
    if (len > 8) {
        const u64 low = ((read64(s + 24) ^ read64(s + 32)) + seed) ^ read64(p);
        const u64 high = ((read64(s + 40) ^ read64(s + 48)) - seed) ^ read64(p + len - 8);
        return avalanche(len + bswap64(low) + high + mul128_fold64(low, high));
    }
    if (len >= 4) {
        const u64 modified_seed = seed ^ (static_cast<u64>(bswap32(static_cast<u32>(seed))) << 32);
        const u64 combined = static_cast<u64>(read32(p + len - 4)) | (static_cast<u64>(read32(p)) << 32);
        u64 v = ((read64(s + 8) ^ read64(s + 16)) - modified_seed) ^ combined;
        v ^= rotl64(v, 49) ^ rotl64(v, 24);
        v *= kPrimeMx2;
        v ^= (v >> 35) + len;
        v *= kPrimeMx2;
        return v ^ (v >> 28);
    }
    if (len > 0) {
        const u32 combined = static_cast<u32>(p[len - 1]) | (static_cast<u32>(len) << 8) |
                             (static_cast<u32>(p[0]) << 16) | (static_cast<u32>(p[len >> 1]) << 24);
        const u64 v = (static_cast<u64>(read32(s) ^ read32(s + 4)) + seed) ^ combined;
        return avalanche_xxh64(v);
    }
    return avalanche_xxh64(seed ^ read64(s + 56) ^ read64(s + 64));
}

// Inline so that chain_hashes gets a copy specialized for its constant block length.
inline u64 hash_17to128(const u8* p, std::size_t len, u64 seed) noexcept {
    const u8* s = kDefaultSecret;
    u64 acc = len * kPrime64_1;
    // The rounds are independent sums; writing them out lets the multiplies overlap.
    if (len > 32) {
        if (len > 64) {
            if (len > 96) {
                acc += mix_step(p + 48, s + 96, seed);
                acc += mix_step(p + len - 64, s + 112, seed);
            }
            acc += mix_step(p + 32, s + 64, seed);
            acc += mix_step(p + len - 48, s + 80, seed);
        }
        acc += mix_step(p + 16, s + 32, seed);
        acc += mix_step(p + len - 32, s + 48, seed);
    }
    acc += mix_step(p, s, seed);
    acc += mix_step(p + len - 16, s + 16, seed);
    return avalanche(acc);
}

u64 hash_129to240(const u8* p, std::size_t len, u64 seed) noexcept {
    const u8* s = kDefaultSecret;
    constexpr std::size_t kStartOffset = 3;
    constexpr std::size_t kLastOffset = 136 - 17;
    u64 acc = len * kPrime64_1;
    for (std::size_t i = 0; i < 8; ++i) acc += mix_step(p + 16 * i, s + 16 * i, seed);
    acc = avalanche(acc);
    const std::size_t chunks = len / 16;
    for (std::size_t i = 8; i < chunks; ++i) acc += mix_step(p + 16 * i, s + 16 * (i - 8) + kStartOffset, seed);
    acc += mix_step(p + len - 16, s + kLastOffset, seed);
    return avalanche(acc);
}

/// The eight lane accumulators of the long-input path.
struct Accumulators {
#if defined(__SSE2__)
    __m128i v[4];  // lanes 2i and 2i+1 in v[i]; locals, so the compiler keeps them in registers

    Accumulators(const u64* init) noexcept {
        for (std::size_t i = 0; i < 4; ++i) v[i] = _mm_set_epi64x(static_cast<long long>(init[2 * i + 1]), static_cast<long long>(init[2 * i]));
    }
    u64 lane(std::size_t i) const noexcept {
        alignas(16) u64 out[2];
        _mm_store_si128(reinterpret_cast<__m128i*>(out), v[i / 2]);
        return out[i % 2];
    }
#else
    u64 v[8];

    Accumulators(const u64* init) noexcept { std::memcpy(v, init, sizeof v); }
    u64 lane(std::size_t i) const noexcept { return v[i]; }
#endif
};

#if defined(__SSE2__)
// SSE2 is part of x86-64, so this path needs no -march flag; two 64-bit lanes per register.
// The spec's 32x32->64 product of a lane's halves is exactly what _mm_mul_epu32 computes.
inline void accumulate_stripe(Accumulators& acc, const u8* stripe, const u8* secret) noexcept {
    for (std::size_t i = 0; i < 4; ++i) {
        const __m128i data = _mm_loadu_si128(reinterpret_cast<const __m128i*>(stripe + 16 * i));
        const __m128i key = _mm_xor_si128(data, _mm_loadu_si128(reinterpret_cast<const __m128i*>(secret + 16 * i)));
        const __m128i key_high = _mm_shuffle_epi32(key, _MM_SHUFFLE(0, 3, 0, 1));
        const __m128i product = _mm_mul_epu32(key, key_high);
        // acc[i ^ 1] += data[i]: the two 64-bit halves of data swapped.
        const __m128i swapped = _mm_shuffle_epi32(data, _MM_SHUFFLE(1, 0, 3, 2));
        acc.v[i] = _mm_add_epi64(acc.v[i], _mm_add_epi64(product, swapped));
    }
}

inline void scramble(Accumulators& acc, const u8* secret) noexcept {
    const __m128i prime = _mm_set1_epi32(static_cast<int>(kPrime32_1));
    for (std::size_t i = 0; i < 4; ++i) {
        __m128i a = acc.v[i];
        a = _mm_xor_si128(a, _mm_srli_epi64(a, 47));
        a = _mm_xor_si128(a, _mm_loadu_si128(reinterpret_cast<const __m128i*>(secret + 16 * i)));
        // 64x32 multiply from two 32x32->64 products: low half, plus high half shifted up.
        const __m128i low = _mm_mul_epu32(a, prime);
        const __m128i high = _mm_mul_epu32(_mm_srli_epi64(a, 32), prime);
        acc.v[i] = _mm_add_epi64(low, _mm_slli_epi64(high, 32));
    }
}
#else
inline void accumulate_stripe(Accumulators& acc, const u8* stripe, const u8* secret) noexcept {
    for (std::size_t i = 0; i < 8; ++i) {
        const u64 data = read64(stripe + 8 * i);
        const u64 key = data ^ read64(secret + 8 * i);
        acc.v[i ^ 1] += data;
        acc.v[i] += (key & 0xFFFFFFFFU) * (key >> 32);
    }
}

inline void scramble(Accumulators& acc, const u8* secret) noexcept {
    for (std::size_t i = 0; i < 8; ++i) {
        u64 a = acc.v[i];
        a ^= a >> 47;
        a ^= read64(secret + 8 * i);
        acc.v[i] = a * kPrime32_1;
    }
}
#endif

u64 hash_large(const u8* p, std::size_t len, const u8* secret) noexcept {
    static constexpr u64 kInit[8] = {kPrime32_3, kPrime64_1, kPrime64_2, kPrime64_3,
                                     kPrime64_4, kPrime32_2, kPrime64_5, kPrime32_1};
    Accumulators acc(kInit);
    // The last block is finished separately even when full, hence len - 1.
    const std::size_t blocks = (len - 1) / kBlockLen;
    for (std::size_t b = 0; b < blocks; ++b) {
        const u8* block = p + b * kBlockLen;
        for (std::size_t n = 0; n < kStripesPerBlock; ++n) accumulate_stripe(acc, block + n * kStripeLen, secret + n * 8);
        scramble(acc, secret + kSecretSize - kStripeLen);
    }
    const u8* last = p + blocks * kBlockLen;
    const std::size_t stripes = ((len - 1) - blocks * kBlockLen) / kStripeLen;
    for (std::size_t n = 0; n < stripes; ++n) accumulate_stripe(acc, last + n * kStripeLen, secret + n * 8);
    accumulate_stripe(acc, p + len - kStripeLen, secret + kSecretSize - kStripeLen - 7);

    constexpr std::size_t kMergeOffset = 11;
    u64 result = len * kPrime64_1;
    for (std::size_t i = 0; i < 4; ++i) {
        const u8* s = secret + kMergeOffset + 16 * i;
        result += mul128_fold64(acc.lane(2 * i) ^ read64(s), acc.lane(2 * i + 1) ^ read64(s + 8));
    }
    return avalanche(result);
}

}  // namespace

std::uint64_t xxh3_64(const void* data, std::size_t len, std::uint64_t seed) noexcept {
    const u8* p = static_cast<const u8*>(data);
    if (len <= 16) return hash_0to16(p, len, seed);
    if (len <= 128) return hash_17to128(p, len, seed);
    if (len <= 240) return hash_129to240(p, len, seed);
    if (seed == 0) return hash_large(p, len, kDefaultSecret);
    // Long inputs use a secret derived from the seed instead of the seed itself.
    alignas(64) u8 secret[kSecretSize];
    for (std::size_t i = 0; i < kSecretSize / 16; ++i) {
        write64(secret + 16 * i, read64(kDefaultSecret + 16 * i) + seed);
        write64(secret + 16 * i + 8, read64(kDefaultSecret + 16 * i + 8) - seed);
    }
    return hash_large(p, len, secret);
}

std::uint64_t root_hash(const void* salt, std::size_t len) noexcept { return xxh3_64(salt, len, 0); }

namespace {

void append_u32le(std::string& out, std::uint32_t v) {
    for (int i = 0; i < 4; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
}

void append_u64le(std::string& out, std::uint64_t v) {
    for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xFF));
}

void append_key(std::string& out, char tag, std::string_view value) {
    out.push_back(tag);
    append_u32le(out, static_cast<std::uint32_t>(value.size()));
    out.append(value.data(), value.size());
}

}  // namespace

void append_mm_key(std::string& out, const MmKey& item) {
    append_key(out, 'M', item.id);
    append_u64le(out, item.offset);
}

std::uint64_t keyed_root(std::uint64_t r0, std::string_view lora, std::string_view cache_salt) {
    if (lora.empty() && cache_salt.empty()) return r0;
    std::string k;
    if (!lora.empty()) append_key(k, 'L', lora);
    if (!cache_salt.empty()) append_key(k, 'C', cache_salt);
    return xxh3_64(k.data(), k.size(), r0);
}

std::size_t chain_hashes_keyed(const std::uint32_t* tokens, std::size_t n_tokens, std::size_t block_size,
                               std::uint64_t seed, std::uint64_t start_pos, const MmKey* items,
                               std::size_t n_items, std::uint64_t* out) {
    if (block_size == 0) return 0;
    const std::size_t count = n_tokens / block_size;
    std::size_t next = 0;  // first item not yet hashed
    std::string payload;
    for (std::size_t b = 0; b < count;) {
        const std::uint64_t begin = start_pos + b * block_size;
        while (next < n_items && items[next].offset < begin) ++next;  // before this call's range
        if (next == n_items || items[next].offset >= begin + block_size) {
            // Blocks up to the next item's block carry no keys: the plain chain.
            std::size_t plain = count - b;
            if (next < n_items) plain = std::min<std::size_t>(plain, (items[next].offset - begin) / block_size);
            chain_hashes(tokens + b * block_size, plain * block_size, block_size, seed, out + b);
            b += plain;
            seed = out[b - 1];
            continue;
        }
        payload.clear();
        for (std::size_t t = 0; t < block_size; ++t) append_u32le(payload, tokens[b * block_size + t]);
        for (; next < n_items && items[next].offset < begin + block_size; ++next) append_mm_key(payload, items[next]);
        seed = xxh3_64(payload.data(), payload.size(), seed);
        out[b++] = seed;
    }
    return count;
}

namespace {

/// OR of the 32-bit words in [p, p + bytes), bytes a multiple of 4, read as 64-bit words.
inline u32 or_words(const u8* p, std::size_t bytes) noexcept {
    // Eight independent lanes: one accumulator makes GCC 12 emit a loop five times slower.
    u64 lanes[8] = {};
    std::size_t i = 0;
    for (; i + 64 <= bytes; i += 64) {
        for (std::size_t k = 0; k < 8; ++k) lanes[k] |= read64(p + i + 8 * k);
    }
    u64 any = 0;
    for (u64 lane : lanes) any |= lane;
    for (; i + 8 <= bytes; i += 8) any |= read64(p + i);
    if (i < bytes) any |= read32(p + i);
    return static_cast<u32>(any) | static_cast<u32>(any >> 32);
}

/// The chain, optionally ORing every hashed token into `seen` (kTrack); one template so that
/// the untracked loop carries no dead work.
template <bool kTrack>
std::size_t chain(const std::uint32_t* tokens, std::size_t n_tokens, std::size_t block_size, u64 seed,
                  u64* out, u32* seen) noexcept {
    if (block_size == 0) return 0;
    const std::size_t count = n_tokens / block_size;
    const std::size_t bytes = block_size * sizeof(std::uint32_t);
    u32 any = 0;
    if (!kLittleEndian) {
        // The contract hashes little-endian token bytes; a big-endian host swaps per block.
        std::vector<u8> buffer(bytes);
        for (std::size_t b = 0; b < count; ++b) {
            for (std::size_t t = 0; t < block_size; ++t) {
                const u32 v = tokens[b * block_size + t];
                if (kTrack) any |= v;
                const u32 le = bswap32(v);
                std::memcpy(buffer.data() + 4 * t, &le, 4);
            }
            seed = xxh3_64(buffer.data(), bytes, seed);
            out[b] = seed;
        }
    } else if (bytes == 64) {
        // vLLM's default block size of 16 tokens: a constant length unrolls the medium path.
        // The OR runs beside the hash, whose speed is set by the latency of the seed chain.
        const u8* p = reinterpret_cast<const u8*>(tokens);
#if defined(__SSE2__)
        // In vector registers the OR uses pipes the integer-bound hash leaves idle.
        __m128i wide = _mm_setzero_si128();
        for (std::size_t b = 0; b < count; ++b, p += 64) {
            if (kTrack) {
                const __m128i* v = reinterpret_cast<const __m128i*>(p);
                wide = _mm_or_si128(wide, _mm_or_si128(_mm_or_si128(_mm_loadu_si128(v), _mm_loadu_si128(v + 1)),
                                                       _mm_or_si128(_mm_loadu_si128(v + 2), _mm_loadu_si128(v + 3))));
            }
            seed = hash_17to128(p, 64, seed);
            out[b] = seed;
        }
        alignas(16) u32 lanes[4];
        _mm_store_si128(reinterpret_cast<__m128i*>(lanes), wide);
        any = lanes[0] | lanes[1] | lanes[2] | lanes[3];
#else
        u64 wide = 0;
        for (std::size_t b = 0; b < count; ++b, p += 64) {
            if (kTrack) {
                wide |= read64(p) | read64(p + 8) | read64(p + 16) | read64(p + 24) | read64(p + 32) |
                        read64(p + 40) | read64(p + 48) | read64(p + 56);
            }
            seed = hash_17to128(p, 64, seed);
            out[b] = seed;
        }
        any = static_cast<u32>(wide) | static_cast<u32>(wide >> 32);
#endif
    } else {
        const u8* p = reinterpret_cast<const u8*>(tokens);
        for (std::size_t b = 0; b < count; ++b, p += bytes) {
            if (kTrack) any |= or_words(p, bytes);
            seed = xxh3_64(p, bytes, seed);
            out[b] = seed;
        }
    }
    if (kTrack) {
        // The unhashed tail is part of the input the caller validates.
        const std::size_t done = count * block_size;
        *seen = any | or_words(reinterpret_cast<const u8*>(tokens + done), (n_tokens - done) * sizeof(u32));
    }
    return count;
}

}  // namespace

std::size_t chain_hashes(const std::uint32_t* tokens, std::size_t n_tokens, std::size_t block_size,
                         std::uint64_t seed, std::uint64_t* out) noexcept {
    return chain<false>(tokens, n_tokens, block_size, seed, out, nullptr);
}

std::size_t chain_hashes(const std::uint32_t* tokens, std::size_t n_tokens, std::size_t block_size,
                         std::uint64_t seed, std::uint64_t* out, std::uint32_t* seen) noexcept {
    return chain<true>(tokens, n_tokens, block_size, seed, out, seen);
}

namespace {

/// Low 32 bits of each value into dst; returns the OR of the values (four lanes, for speed).
inline u64 narrow_or(const u64* src, std::size_t n, u32* dst) noexcept {
    u64 lanes[4] = {};
    std::size_t i = 0;
    for (; i + 4 <= n; i += 4) {
        for (std::size_t k = 0; k < 4; ++k) {
            lanes[k] |= src[i + k];
            dst[i + k] = static_cast<u32>(src[i + k]);
        }
    }
    u64 any = lanes[0] | lanes[1] | lanes[2] | lanes[3];
    for (; i < n; ++i) {
        any |= src[i];
        dst[i] = static_cast<u32>(src[i]);
    }
    return any;
}

}  // namespace

std::size_t chain_hashes(const std::uint64_t* tokens, std::size_t n_tokens, std::size_t block_size,
                         std::uint64_t seed, std::uint64_t* out, std::uint64_t* seen) {
    // Narrowed a chunk at a time into a buffer that stays in L1, instead of a copy of the
    // whole prompt: no allocation and one pass over the input for typical block sizes.
    constexpr std::size_t kChunkTokens = 2048;
    u64 any = 0;
    std::size_t done = 0;
    std::size_t count = 0;
#if defined(__SSE2__)
    if (block_size == 16 && kLittleEndian) {
        // The default block: each block is narrowed in vector registers right before it is
        // hashed; that work does not depend on the seed, so it overlaps the seed chain.
        count = n_tokens / 16;
        __m128i wide = _mm_setzero_si128();
        alignas(16) u8 block[64];
        const auto* v = reinterpret_cast<const __m128i*>(tokens);
        for (std::size_t b = 0; b < count; ++b, v += 8) {
            for (std::size_t q = 0; q < 4; ++q) {
                const __m128i a = _mm_loadu_si128(v + 2 * q);
                const __m128i c = _mm_loadu_si128(v + 2 * q + 1);
                wide = _mm_or_si128(wide, _mm_or_si128(a, c));
                // Low 32 bits of the four values, in order: (a0 a1 c0 c1).
                const __m128i packed = _mm_unpacklo_epi64(_mm_shuffle_epi32(a, _MM_SHUFFLE(2, 0, 2, 0)),
                                                          _mm_shuffle_epi32(c, _MM_SHUFFLE(2, 0, 2, 0)));
                _mm_store_si128(reinterpret_cast<__m128i*>(block + 16 * q), packed);
            }
            seed = hash_17to128(block, 64, seed);
            out[b] = seed;
        }
        alignas(16) u64 halves[2];
        _mm_store_si128(reinterpret_cast<__m128i*>(halves), wide);
        any = halves[0] | halves[1];
        done = count * 16;
    } else
#endif
    if (block_size != 0) {
        count = n_tokens / block_size;
        const std::size_t per_chunk = block_size >= kChunkTokens ? block_size : kChunkTokens / block_size * block_size;
        u32 stack_buffer[kChunkTokens];
        std::vector<u32> heap_buffer;
        u32* buffer = stack_buffer;
        if (per_chunk > kChunkTokens && count > 0) {
            heap_buffer.resize(per_chunk);
            buffer = heap_buffer.data();
        }
        for (std::size_t written = 0; written < count;) {
            const std::size_t blocks = std::min(per_chunk / block_size, count - written);
            const std::size_t len = blocks * block_size;
            any |= narrow_or(tokens + done, len, buffer);
            chain<false>(buffer, len, block_size, seed, out + written, nullptr);
            seed = out[written + blocks - 1];
            written += blocks;
            done += len;
        }
    }
    u64 lanes[4] = {};
    for (; done + 4 <= n_tokens; done += 4) {
        for (std::size_t k = 0; k < 4; ++k) lanes[k] |= tokens[done + k];
    }
    for (; done < n_tokens; ++done) any |= tokens[done];
    *seen = any | lanes[0] | lanes[1] | lanes[2] | lanes[3];
    return count;
}

}  // namespace kvroute
