// msgpack reader (see msgpack.hpp); formats from the msgpack specification.
#include "kvroute/msgpack.hpp"

#include <cstring>

namespace kvroute::msgpack {
namespace {

std::uint64_t be(const std::uint8_t* p, int n) noexcept {
    std::uint64_t v = 0;
    for (int i = 0; i < n; ++i) v = (v << 8) | p[i];
    return v;
}

// msgspec turns ext type -1 into a datetime and rejects what a datetime cannot hold.
bool valid_timestamp(const std::uint8_t* d, std::uint32_t len) noexcept {
    if (len == 4) return true;
    if (len == 8) return (be(d, 8) >> 34) <= 999999999u;
    if (len == 12) {
        if (be(d, 4) > 999999999u) return false;
        const auto secs = static_cast<std::int64_t>(be(d + 4, 8));
        return secs >= -62135596800LL && secs <= 253402300799LL;
    }
    return false;
}

struct Validator {
    const std::uint8_t* p;
    const std::uint8_t* end;

    bool need(std::size_t n) const noexcept { return static_cast<std::size_t>(end - p) >= n; }

    bool bytes(std::size_t n) noexcept {
        if (!need(n)) return false;
        p += n;
        return true;
    }
    bool str(std::size_t n) noexcept {
        if (!need(n) || !valid_utf8(p, n)) return false;
        p += n;
        return true;
    }
    bool ext(std::size_t n, bool key) noexcept {
        if (!need(n + 1)) return false;
        const auto type = static_cast<std::int8_t>(p[0]);
        const std::uint8_t* d = p + 1;
        p += n + 1;
        if (type == -1) return valid_timestamp(d, static_cast<std::uint32_t>(n));
        return !key;  // msgspec's Ext objects are not hashable
    }
    bool seq(std::uint64_t n, int depth, bool key) noexcept {
        if (depth >= kMaxDepth) return false;
        for (std::uint64_t i = 0; i < n; ++i) {
            // Ints inline: token id and hash arrays are most of a batch.
            if (p < end) {
                const std::uint8_t c = *p;
                if (c <= 0x7F || c >= 0xE0) {
                    ++p;
                    continue;
                }
                const int size = c == 0xCD ? 3 : c == 0xCE ? 5 : c == 0xCF ? 9 : c == 0xCC ? 2 : 0;
                if (size > 0) {
                    if (!need(static_cast<std::size_t>(size))) return false;
                    p += size;
                    continue;
                }
            }
            if (!value(depth + 1, key)) return false;
        }
        return true;
    }
    bool map(std::uint64_t n, int depth, bool key) noexcept {
        if (key || depth >= kMaxDepth) return false;  // a dict is not hashable
        for (std::uint64_t i = 0; i < n; ++i)
            if (!value(depth + 1, true) || !value(depth + 1, false)) return false;
        return true;
    }
    // `key`: the object is (inside) a map key, where msgspec needs a hashable value.
    bool value(int depth, bool key) noexcept {
        if (!need(1)) return false;
        const std::uint8_t c = *p++;
        if (c <= 0x7F || c >= 0xE0) return true;
        if (c >= 0x80 && c <= 0x8F) return map(c & 0x0Fu, depth, key);
        if (c >= 0x90 && c <= 0x9F) return seq(c & 0x0Fu, depth, key);
        if (c >= 0xA0 && c <= 0xBF) return str(c & 0x1Fu);
        switch (c) {
            case 0xC0: case 0xC2: case 0xC3: return true;
            case 0xC4: return need(1) && (p += 1, bytes(be(p - 1, 1)));
            case 0xC5: return need(2) && (p += 2, bytes(be(p - 2, 2)));
            case 0xC6: return need(4) && (p += 4, bytes(be(p - 4, 4)));
            case 0xC7: return need(1) && (p += 1, ext(be(p - 1, 1), key));
            case 0xC8: return need(2) && (p += 2, ext(be(p - 2, 2), key));
            case 0xC9: return need(4) && (p += 4, ext(be(p - 4, 4), key));
            case 0xCA: return bytes(4);
            case 0xCB: return bytes(8);
            case 0xCC: case 0xD0: return bytes(1);
            case 0xCD: case 0xD1: return bytes(2);
            case 0xCE: case 0xD2: return bytes(4);
            case 0xCF: case 0xD3: return bytes(8);
            case 0xD4: return ext(1, key);
            case 0xD5: return ext(2, key);
            case 0xD6: return ext(4, key);
            case 0xD7: return ext(8, key);
            case 0xD8: return ext(16, key);
            case 0xD9: return need(1) && (p += 1, str(be(p - 1, 1)));
            case 0xDA: return need(2) && (p += 2, str(be(p - 2, 2)));
            case 0xDB: return need(4) && (p += 4, str(be(p - 4, 4)));
            case 0xDC: return need(2) && (p += 2, seq(be(p - 2, 2), depth, key));
            case 0xDD: return need(4) && (p += 4, seq(be(p - 4, 4), depth, key));
            case 0xDE: return need(2) && (p += 2, map(be(p - 2, 2), depth, key));
            case 0xDF: return need(4) && (p += 4, map(be(p - 4, 4), depth, key));
            default: return false;  // 0xC1 is never used
        }
    }
};

double f32(const std::uint8_t* p) noexcept {
    const auto bits = static_cast<std::uint32_t>(be(p, 4));
    float f;
    std::memcpy(&f, &bits, 4);
    return static_cast<double>(f);
}

double f64(const std::uint8_t* p) noexcept {
    const std::uint64_t bits = be(p, 8);
    double f;
    std::memcpy(&f, &bits, 8);
    return f;
}

Item sized(Type t, const std::uint8_t*& p, std::uint64_t n) noexcept {
    Item it;
    it.type = t;
    it.len = static_cast<std::uint32_t>(n);
    it.data = p;
    p += n;
    return it;
}

Item counted(Type t, std::uint64_t n) noexcept {
    Item it;
    it.type = t;
    it.len = static_cast<std::uint32_t>(n);
    return it;
}

Item integer(std::uint64_t u, bool negative) noexcept {
    Item it;
    it.type = Type::Int;
    it.u = u;
    it.negative = negative;
    return it;
}

Item signed_int(std::int64_t v) noexcept { return integer(static_cast<std::uint64_t>(v), v < 0); }

}  // namespace

bool valid_utf8(const std::uint8_t* s, std::size_t n) noexcept {
    std::size_t i = 0;
    while (i < n) {
        const std::uint8_t c = s[i];
        if (c < 0x80) {
            ++i;
            continue;
        }
        auto cont = [&](std::size_t k) { return i + k < n && (s[i + k] & 0xC0) == 0x80; };
        if (c >= 0xC2 && c <= 0xDF) {
            if (!cont(1)) return false;
            i += 2;
        } else if (c >= 0xE0 && c <= 0xEF) {
            if (!cont(1) || !cont(2)) return false;
            const std::uint8_t d = s[i + 1];
            // Overlong forms (E0 80..9F) and UTF-16 surrogates (ED A0..BF) are invalid.
            if ((c == 0xE0 && d < 0xA0) || (c == 0xED && d > 0x9F)) return false;
            i += 3;
        } else if (c >= 0xF0 && c <= 0xF4) {
            if (!cont(1) || !cont(2) || !cont(3)) return false;
            const std::uint8_t d = s[i + 1];
            if ((c == 0xF0 && d < 0x90) || (c == 0xF4 && d > 0x8F)) return false;
            i += 4;
        } else {
            return false;
        }
    }
    return true;
}

const char* type_name(Type t) noexcept {
    switch (t) {
        case Type::Nil: return "nil";
        case Type::Bool: return "bool";
        case Type::Int: return "int";
        case Type::Float: return "float";
        case Type::Str: return "str";
        case Type::Bin: return "bin";
        case Type::Array: return "array";
        case Type::Map: return "map";
        case Type::Ext: return "ext";
    }
    return "?";
}

bool validate(const std::uint8_t* data, std::size_t len) noexcept {
    Validator v{data, data + len};
    return v.value(0, false) && v.p == v.end;
}

Item next(const std::uint8_t*& p) noexcept {
    const std::uint8_t c = *p++;
    if (c <= 0x7F) return integer(c, false);
    if (c >= 0xE0) return signed_int(static_cast<std::int8_t>(c));
    if (c <= 0x8F) return counted(Type::Map, c & 0x0Fu);
    if (c <= 0x9F) return counted(Type::Array, c & 0x0Fu);
    if (c <= 0xBF) return sized(Type::Str, p, c & 0x1Fu);
    Item it;
    std::uint64_t n = 0;
    switch (c) {
        case 0xC0: return it;
        case 0xC2: case 0xC3:
            it.type = Type::Bool;
            it.boolean = c == 0xC3;
            return it;
        case 0xC4: n = be(p, 1); p += 1; return sized(Type::Bin, p, n);
        case 0xC5: n = be(p, 2); p += 2; return sized(Type::Bin, p, n);
        case 0xC6: n = be(p, 4); p += 4; return sized(Type::Bin, p, n);
        case 0xC7: n = be(p, 1); p += 1; return sized(Type::Ext, p, n + 1);
        case 0xC8: n = be(p, 2); p += 2; return sized(Type::Ext, p, n + 1);
        case 0xC9: n = be(p, 4); p += 4; return sized(Type::Ext, p, n + 1);
        case 0xCA: it.type = Type::Float; it.f = f32(p); p += 4; return it;
        case 0xCB: it.type = Type::Float; it.f = f64(p); p += 8; return it;
        case 0xCC: n = be(p, 1); p += 1; return integer(n, false);
        case 0xCD: n = be(p, 2); p += 2; return integer(n, false);
        case 0xCE: n = be(p, 4); p += 4; return integer(n, false);
        case 0xCF: n = be(p, 8); p += 8; return integer(n, false);
        case 0xD0: n = be(p, 1); p += 1; return signed_int(static_cast<std::int8_t>(n));
        case 0xD1: n = be(p, 2); p += 2; return signed_int(static_cast<std::int16_t>(n));
        case 0xD2: n = be(p, 4); p += 4; return signed_int(static_cast<std::int32_t>(n));
        case 0xD3: n = be(p, 8); p += 8; return signed_int(static_cast<std::int64_t>(n));
        case 0xD4: return sized(Type::Ext, p, 2);
        case 0xD5: return sized(Type::Ext, p, 3);
        case 0xD6: return sized(Type::Ext, p, 5);
        case 0xD7: return sized(Type::Ext, p, 9);
        case 0xD8: return sized(Type::Ext, p, 17);
        case 0xD9: n = be(p, 1); p += 1; return sized(Type::Str, p, n);
        case 0xDA: n = be(p, 2); p += 2; return sized(Type::Str, p, n);
        case 0xDB: n = be(p, 4); p += 4; return sized(Type::Str, p, n);
        case 0xDC: n = be(p, 2); p += 2; return counted(Type::Array, n);
        case 0xDD: n = be(p, 4); p += 4; return counted(Type::Array, n);
        case 0xDE: n = be(p, 2); p += 2; return counted(Type::Map, n);
        case 0xDF: n = be(p, 4); p += 4; return counted(Type::Map, n);
        default: return it;
    }
}

void skip(const std::uint8_t*& p) noexcept {
    // Elements still to skip; iterative so that deep nesting cannot exhaust the stack.
    std::uint64_t pending = 1;
    while (pending > 0) {
        --pending;
        // Scalars of fixed size (token ids, nil, bools) without decoding them.
        const std::uint8_t c = *p;
        if (c <= 0x7F || c >= 0xE0 || c == 0xC0 || c == 0xC2 || c == 0xC3) {
            p += 1;
            continue;
        }
        if (c == 0xCC || c == 0xD0) {
            p += 2;
            continue;
        }
        if (c == 0xCD || c == 0xD1) {
            p += 3;
            continue;
        }
        if (c == 0xCE || c == 0xD2 || c == 0xCA) {
            p += 5;
            continue;
        }
        if (c == 0xCF || c == 0xD3 || c == 0xCB) {
            p += 9;
            continue;
        }
        const Item it = next(p);
        if (it.type == Type::Array) pending += it.len;
        else if (it.type == Type::Map) pending += 2ull * it.len;
    }
}

}  // namespace kvroute::msgpack
