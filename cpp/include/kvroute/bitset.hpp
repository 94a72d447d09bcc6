// Replica sets as plain arrays of 64-bit words. The prefix index keeps one such set per node
// in a strided arena, so these work on raw word spans rather than on an owning object.
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

namespace kvroute::bits {

/// Number of 64-bit words that hold n bits.
constexpr std::size_t words_for(std::size_t n) noexcept { return (n + 63) / 64; }

/// Whether bit i is set.
inline bool test(const std::uint64_t* w, std::size_t i) noexcept {
    return (w[i >> 6] >> (i & 63)) & 1u;
}
/// Sets bit i.
inline void set(std::uint64_t* w, std::size_t i) noexcept { w[i >> 6] |= std::uint64_t{1} << (i & 63); }
/// Clears bit i.
inline void clear(std::uint64_t* w, std::size_t i) noexcept {
    w[i >> 6] &= ~(std::uint64_t{1} << (i & 63));
}
/// Whether any bit of the n words is set.
inline bool any(const std::uint64_t* w, std::size_t n) noexcept {
    for (std::size_t k = 0; k < n; ++k)
        if (w[k]) return true;
    return false;
}
/// Whether two n-word sets are equal.
inline bool equal(const std::uint64_t* a, const std::uint64_t* b, std::size_t n) noexcept {
    for (std::size_t k = 0; k < n; ++k)
        if (a[k] != b[k]) return false;
    return true;
}
/// Number of set bits in n words.
inline std::size_t count(const std::uint64_t* w, std::size_t n) noexcept {
    std::size_t c = 0;
    for (std::size_t k = 0; k < n; ++k) c += static_cast<std::size_t>(__builtin_popcountll(w[k]));
    return c;
}
/// Calls fn(i) for every set bit i of n words, in increasing order.
template <class Fn>
inline void for_each(const std::uint64_t* w, std::size_t n, Fn&& fn) {
    for (std::size_t k = 0; k < n; ++k) {
        std::uint64_t x = w[k];
        while (x) {
            fn(k * 64 + static_cast<std::size_t>(__builtin_ctzll(x)));
            x &= x - 1;
        }
    }
}

/// An owning replica set, for callers that need one outside an arena.
class Bitset {
public:
    Bitset() = default;
    /// An empty set able to hold bits [0, n).
    explicit Bitset(std::size_t n) : words_(words_for(n), 0) {}
    /// Whether bit i is set (false beyond the size).
    bool test(std::size_t i) const noexcept { return (i >> 6) < words_.size() && bits::test(words_.data(), i); }
    /// Sets bit i, growing as needed.
    void set(std::size_t i) {
        if ((i >> 6) >= words_.size()) words_.resize((i >> 6) + 1, 0);
        bits::set(words_.data(), i);
    }
    /// Clears bit i.
    void clear(std::size_t i) noexcept {
        if ((i >> 6) < words_.size()) bits::clear(words_.data(), i);
    }
    /// The words (bit i of the set is bit i%64 of word i/64).
    const std::vector<std::uint64_t>& words() const noexcept { return words_; }

private:
    std::vector<std::uint64_t> words_;
};

}  // namespace kvroute::bits
