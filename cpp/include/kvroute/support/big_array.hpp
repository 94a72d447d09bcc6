// A fixed-size array for big hash tables, on transparent huge pages where the OS offers them;
// used by the prefix index's tables.
#pragma once
#include <cstddef>
#include <cstdlib>
#include <memory>
#include <new>
#include <type_traits>
#include <utility>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace kvroute::support {

/// A fixed-size, value-filled array of trivially copyable T for big tables. Lookups are random accesses, and
/// with 4 KiB pages most of them would miss the TLB too, so on Linux arrays of 2 MiB and
/// more are 2 MiB-aligned and asked for transparent huge pages before they are touched.
template <class T>
class BigArray {
    static_assert(std::is_trivially_copyable_v<T>, "BigArray frees its memory without destructors");
public:
    BigArray() = default;
    BigArray(const BigArray&) = delete;
    BigArray& operator=(const BigArray&) = delete;
    ~BigArray() { std::free(p_); }
    void swap(BigArray& o) noexcept {
        std::swap(p_, o.p_);
        std::swap(n_, o.n_);
        std::swap(bytes_, o.bytes_);
    }
    /// n copies of v (previous contents dropped).
    void assign(std::size_t n, const T& v) {
        BigArray next;
        if (n) {
            std::size_t bytes = n * sizeof(T);
            void* p = nullptr;
            if (bytes >= kHuge) {
                bytes = (bytes + kHuge - 1) / kHuge * kHuge;
                p = std::aligned_alloc(kHuge, bytes);
#if defined(__linux__) && defined(MADV_HUGEPAGE)
                if (p) ::madvise(p, bytes, MADV_HUGEPAGE);  // advice only: failure is harmless
#endif
            } else {
                p = std::malloc(bytes);
            }
            if (!p) throw std::bad_alloc();
            next.p_ = static_cast<T*>(p);
            next.n_ = n;
            next.bytes_ = bytes;
            std::uninitialized_fill_n(next.p_, n, v);
        }
        swap(next);
    }
    bool empty() const noexcept { return n_ == 0; }
    std::size_t size() const noexcept { return n_; }
    std::size_t bytes() const noexcept { return bytes_; }
    T* data() noexcept { return p_; }
    T& operator[](std::size_t i) noexcept { return p_[i]; }
    const T& operator[](std::size_t i) const noexcept { return p_[i]; }

private:
    static constexpr std::size_t kHuge = std::size_t{2} << 20;
    T* p_ = nullptr;
    std::size_t n_ = 0;
    std::size_t bytes_ = 0;
};

}  // namespace kvroute::support
