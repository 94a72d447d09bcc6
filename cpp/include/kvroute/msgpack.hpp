// A small msgpack reader written from the msgpack specification, for engine KV event batches.
// validate() accepts exactly what msgspec's generic decoder (the reference twin) accepts, so
// both implementations agree on which payloads are "not valid msgpack"; the cursor functions
// then walk validated data without further checks.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace kvroute::msgpack {

/// Most containers validate() lets nest (a container inside kMaxDepth others is refused); the
/// reference enforces the same limit (python/kvroute/reference/events.py MAX_DEPTH). An event
/// batch needs 6 (batch, events, event, extra_keys, one block's keys, a (id, offset) pair).
inline constexpr int kMaxDepth = 32;

/// The msgpack types, as error messages name them.
enum class Type : std::uint8_t { Nil, Bool, Int, Float, Str, Bin, Array, Map, Ext };

/// Name of a type in error messages: nil, bool, int, float, str, bin, array, map, ext.
const char* type_name(Type t) noexcept;

/// One object header read at a cursor.
struct Item {
    Type type = Type::Nil;
    bool boolean = false;       ///< Bool value
    bool negative = false;      ///< Int: value < 0 (then `u` is its two's complement)
    std::uint64_t u = 0;        ///< Int value, bit-cast when negative
    double f = 0.0;             ///< Float value (float32 widened)
    const std::uint8_t* data = nullptr;  ///< Str/Bin/Ext bytes
    std::uint32_t len = 0;      ///< Str/Bin/Ext byte length, or Array/Map element count

    /// Str contents (only for Type::Str).
    std::string_view str() const noexcept {
        return {reinterpret_cast<const char*>(data), len};
    }
};

/// Whether [data, data+len) is exactly one well-formed object with valid UTF-8 strings,
/// hashable map keys and valid timestamp extensions, and nothing after it.
bool validate(const std::uint8_t* data, std::size_t len) noexcept;

/// Reads the header at p and advances p past it: past the bytes of a Str/Bin/Ext, but only
/// past the header of an Array/Map (its elements follow). Validated data only.
Item next(const std::uint8_t*& p) noexcept;

/// Advances p past one whole object. Validated data only.
void skip(const std::uint8_t*& p) noexcept;

/// Whether s[0, n) is valid UTF-8 (no overlong forms, no surrogates), as Python decodes it.
bool valid_utf8(const std::uint8_t* s, std::size_t n) noexcept;

}  // namespace kvroute::msgpack
