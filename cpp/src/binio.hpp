// Little-endian binary writing and bounds-checked reading for snapshots
// (docs/snapshot-format.md). Twin of python/kvroute/reference/binio.py: a Reader never reads
// past its end; a short read throws ValueError("<what> is truncated"). Assumes a
// little-endian host (x86-64, aarch64), as the rest of the core's byte handling does.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>

#include "kvroute/errors.hpp"
#include "kvroute/msgpack.hpp"

namespace kvroute::binio {

/// Appends little-endian fields to a string.
class Writer {
public:
    /// The bytes written so far.
    std::string buf;
    /// One byte.
    void u8(std::uint8_t v) { buf.push_back(static_cast<char>(v)); }
    /// Two bytes.
    void u16(std::uint16_t v) { raw(&v, 2); }
    /// Four bytes.
    void u32(std::uint32_t v) { raw(&v, 4); }
    /// Eight bytes.
    void u64(std::uint64_t v) { raw(&v, 8); }
    /// An IEEE-754 double.
    void f64(double v) { raw(&v, 8); }
    /// n bytes as they are.
    void raw(const void* p, std::size_t n) {
        if (n) buf.append(static_cast<const char*>(p), n);  // an empty vector's data() may be null
    }
    /// A byte string: u32 length, then the bytes.
    void text(const std::string& s) {
        u32(static_cast<std::uint32_t>(s.size()));
        buf.append(s);
    }
};

/// Reads little-endian fields from data[pos, end).
class Reader {
public:
    /// Reads data[pos, end); `what` names the whole in errors.
    Reader(const std::uint8_t* data, std::size_t pos, std::size_t end, const char* what) noexcept
        : data_(data), pos_(pos), end_(end), what_(what) {}
    /// One byte.
    std::uint8_t u8() { return data_[take(1)]; }
    /// Two bytes.
    std::uint16_t u16() { return get<std::uint16_t>(); }
    /// Four bytes.
    std::uint32_t u32() { return get<std::uint32_t>(); }
    /// Eight bytes.
    std::uint64_t u64() { return get<std::uint64_t>(); }
    /// An IEEE-754 double.
    double f64() { return get<double>(); }
    /// Pointer to the next n bytes, skipped.
    const std::uint8_t* raw(std::size_t n) { return data_ + take(n); }
    /// A byte string: u32 length, then the bytes.
    std::string text() {
        const std::size_t n = u32();
        const std::uint8_t* p = raw(n);
        return std::string(reinterpret_cast<const char*>(p), n);
    }
    /// A u64 count of items of at least item_bytes each, refused unless they can fit in what
    /// is left (so no count makes a reader allocate beyond its input).
    std::uint64_t count(std::size_t item_bytes) {
        const std::uint64_t n = u64();
        if (n > left() / item_bytes) truncated();
        return n;
    }
    /// Bytes left.
    std::size_t left() const noexcept { return end_ - pos_; }
    /// The read position.
    std::size_t pos() const noexcept { return pos_; }
    /// Throws ValueError("<what> is truncated").
    [[noreturn]] void truncated() const { throw ValueError(std::string(what_) + " is truncated"); }

private:
    std::size_t take(std::size_t n) {
        if (n > end_ - pos_) truncated();
        const std::size_t p = pos_;
        pos_ += n;
        return p;
    }
    template <class T>
    T get() {
        T v;
        std::memcpy(&v, data_ + take(sizeof(T)), sizeof(T));
        return v;
    }
    const std::uint8_t* data_;
    std::size_t pos_, end_;
    const char* what_;
};

/// Whether s is valid UTF-8 (what Python's bytes.decode("utf-8") accepts).
inline bool valid_utf8(const std::string& s) noexcept {
    return msgpack::valid_utf8(reinterpret_cast<const std::uint8_t*>(s.data()), s.size());
}

}  // namespace kvroute::binio
