// Open-addressing hash map from 64-bit keys, shared by the event applier's per-replica maps.
#pragma once
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

#include "kvroute/support/mix.hpp"

namespace kvroute::support {

/// Open-addressing map from 64-bit keys (linear probing, backward-shift deletion): the
/// per-block maps are the hot path, and node-based maps allocate per block. Key, flag and
/// value share a slot so that a lookup touches one cache line.
template <class V>
class HashMap {
public:
    std::size_t size() const noexcept { return size_; }

    V* find(std::uint64_t key) noexcept {
        if (size_ == 0) return nullptr;
        for (std::size_t i = slot(key);; i = (i + 1) & mask_) {
            Slot& s = slots_[i];
            if (!s.used) return nullptr;
            if (s.key == key) return &s.val;
        }
    }
    const V* find(std::uint64_t key) const noexcept {
        return const_cast<HashMap*>(this)->find(key);
    }
    /// The value for key, default-constructed (and `inserted` set) when new.
    V& get(std::uint64_t key, bool& inserted) {
        if ((size_ + 1) * 2 > slots_.size()) grow();
        for (std::size_t i = slot(key);; i = (i + 1) & mask_) {
            Slot& s = slots_[i];
            if (!s.used) {
                s.used = true;
                s.key = key;
                ++size_;
                inserted = true;
                return s.val;  // empty slots always hold V{}
            }
            if (s.key == key) {
                inserted = false;
                return s.val;
            }
        }
    }
    bool erase(std::uint64_t key) noexcept {
        if (size_ == 0) return false;
        std::size_t i = slot(key);
        for (;; i = (i + 1) & mask_) {
            if (!slots_[i].used) return false;
            if (slots_[i].key == key) break;
        }
        // Backward shift: move later members of the probe run into the hole.
        std::size_t hole = i;
        for (std::size_t j = (i + 1) & mask_; slots_[j].used; j = (j + 1) & mask_) {
            const std::size_t home = slot(slots_[j].key);
            const bool movable = hole <= j ? (home <= hole || home > j) : (home <= hole && home > j);
            if (movable) {
                slots_[hole].key = slots_[j].key;
                slots_[hole].val = std::move(slots_[j].val);
                hole = j;
            }
        }
        slots_[hole].used = false;
        slots_[hole].val = V{};
        --size_;
        return true;
    }
    /// Calls f(key, value) for every member (no insertions or erasures during the walk).
    template <class F>
    void for_each(F&& f) {
        for (Slot& s : slots_)
            if (s.used) f(s.key, s.val);
    }
    /// Calls f(key, value) for every member, read-only.
    template <class F>
    void for_each(F&& f) const {
        for (const Slot& s : slots_)
            if (s.used) f(s.key, s.val);
    }
    /// Empties the map but keeps its slots: an engine that cleared its cache refills it.
    void clear() {
        if (size_ == 0) return;
        for (Slot& s : slots_) {
            if (s.used) {
                s.used = false;
                s.val = V{};
            }
        }
        size_ = 0;
    }

private:
    struct Slot {
        std::uint64_t key = 0;
        bool used = false;
        V val{};
    };

    std::size_t slot(std::uint64_t key) const noexcept {
        return static_cast<std::size_t>(mix64(key)) & mask_;
    }
    void grow() {
        const std::size_t cap = slots_.empty() ? 16 : slots_.size() * 2;
        std::vector<Slot> old(cap);
        std::swap(old, slots_);
        mask_ = cap - 1;
        for (Slot& s : old) {
            if (!s.used) continue;
            std::size_t i = slot(s.key);
            while (slots_[i].used) i = (i + 1) & mask_;
            slots_[i].used = true;
            slots_[i].key = s.key;
            slots_[i].val = std::move(s.val);
        }
    }

    std::vector<Slot> slots_;
    std::size_t size_ = 0;
    std::size_t mask_ = 0;
};

}  // namespace kvroute::support
