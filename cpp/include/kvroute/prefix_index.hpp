// PrefixIndex: which replica holds which KV blocks, as a compressed radix tree of chained
// block hashes with one replica bitset per node. Twin of python/kvroute/reference/index.py.
//
// Semantics (shared with the reference; see its docstrings for the full contract):
// - A block is its chained hash. insert() takes a chain from the root; store_after() continues
//   a chain after a known parent block. A hash already in the index under another parent, or
//   repeated in one chain, is a ValueError.
// - A block nobody holds is freed at once, except that it stays as an ownerless placeholder
//   while a held block descends from it.
// - Replica ids are dense, 0..num_replicas()-1; remove_replica() retires an id (later use is
//   IndexError "replica r was removed") and add_replica() reuses the lowest retired id.
// - With a capacity or a ttl, each (replica, block) has a place in the replica's LRU order;
//   insert/store_after/touch refresh the given blocks deepest first, so a chain's suffix is
//   evicted before its prefix. Time never runs backwards: a `now` earlier than one already
//   seen counts as that latest time.
// - Every method validates all of its input before it changes anything: after an exception
//   the index is exactly as before. Thread-safe: readers share, writers exclude.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <vector>

namespace kvroute {

/// Counters and sizes of a PrefixIndex, read under one lock.
struct PrefixIndexStats {
    std::uint64_t blocks = 0;            ///< distinct blocks held by at least one replica
    std::uint64_t placeholders = 0;      ///< ownerless blocks kept for a held descendant
    std::uint64_t nodes = 0;             ///< radix-tree nodes (runs with one owner set)
    std::uint64_t bytes = 0;             ///< heap bytes owned by the index
    std::uint64_t held = 0;              ///< (replica, block) pairs
    std::uint32_t num_replicas = 0;      ///< ids in use or retired: 0..num_replicas-1
    std::uint32_t live_replicas = 0;     ///< ids not retired
    std::vector<std::uint64_t> replica_blocks;  ///< blocks per replica id (0 when retired)
    std::uint64_t unknown_removals = 0;  ///< remove() hashes the replica did not hold
    std::uint64_t evictions = 0;         ///< (replica, block) pairs dropped for capacity
    std::uint64_t expirations = 0;       ///< (replica, block) pairs dropped by expire()
    std::uint64_t eviction_log = 0;      ///< pairs waiting in the eviction log
    std::uint64_t evictions_dropped = 0; ///< pairs not logged because the log was full
};

/// One replica's contents as PrefixIndex::export_replica gives them and import_replica takes
/// them (snapshots): blocks in depth-first preorder from the root, siblings by ascending hash.
struct ReplicaContents {
    std::vector<std::uint64_t> hashes;  ///< held blocks and the ancestors their chains hang from
    std::vector<std::int64_t> parents;  ///< index of each block's parent in hashes; -1 at the root
    std::vector<std::int64_t> held;     ///< indices of held blocks, least recent first
    std::vector<double> ages;           ///< seconds since each held block was last touched
};

/// Compressed radix tree of block hashes with per-replica ownership bitsets.
class PrefixIndex {
public:
    /// Most replica ids an index can have.
    static constexpr std::uint32_t kMaxReplicas = 65536;
    /// Most (replica, hash) pairs the eviction log keeps between pop_evictions() calls.
    static constexpr std::size_t kEvictionLogLimit = std::size_t{1} << 20;

    /// An index with ids 0..num_replicas-1; capacity in blocks per replica, ttl in seconds
    /// (both optional; checked: capacity >= 1, ttl > 0 and finite).
    explicit PrefixIndex(std::uint32_t num_replicas = 0,
                         std::optional<std::uint64_t> capacity = std::nullopt,
                         std::optional<double> ttl = std::nullopt, bool record_evictions = false);
    ~PrefixIndex();
    PrefixIndex(const PrefixIndex&) = delete;
    PrefixIndex& operator=(const PrefixIndex&) = delete;

    /// Seconds on std::chrono::steady_clock (what Python's time.monotonic() reads on Linux).
    static double monotonic_now() noexcept;

    /// Number of replica ids, retired ones included.
    std::uint32_t num_replicas() const;
    /// Whether r is an id in range that is not retired.
    bool is_live(std::int64_t r) const;
    /// Throws IndexError "replica r is out of range [0, n)" or "replica r was removed".
    void check_replica(std::int64_t r) const;
    /// Blocks per replica before eviction, if any.
    std::optional<std::uint64_t> capacity() const noexcept;
    /// Seconds a (replica, block) lives untouched, if any.
    std::optional<double> ttl() const noexcept;
    /// Whether capacity evictions and expirations are logged for pop_evictions().
    bool record_evictions() const noexcept;

    /// A new replica id: the lowest retired id, else num_replicas() (which then grows).
    std::uint32_t add_replica();
    /// Drops r's blocks and retires its id.
    void remove_replica(std::int64_t r);
    /// Drops r's blocks; r stays live (an engine's AllBlocksCleared).
    void clear_replica(std::int64_t r);
    /// Drops every block of every replica; ids stay as they are.
    void clear();

    /// r holds the chain hashes[0..n) from the root; returns blocks r did not hold before.
    std::size_t insert(std::int64_t r, const std::uint64_t* hashes, std::size_t n, double now);
    /// r holds hashes[0..n), continuing the chain after block `parent` (KeyError if unknown).
    std::size_t store_after(std::int64_t r, std::uint64_t parent, const std::uint64_t* hashes,
                            std::size_t n, double now);
    /// out[r] = leading blocks of hashes[0..n) replica r holds; out is resized to num_replicas().
    void match(const std::uint64_t* hashes, std::size_t n, std::vector<std::int32_t>& out) const;
    /// r stops holding these blocks (any order); returns how many it held. Others are counted
    /// in unknown_removals.
    std::size_t remove(std::int64_t r, const std::uint64_t* hashes, std::size_t n);
    /// Refreshes the blocks r holds among hashes (deepest first); returns how many it held.
    std::size_t touch(std::int64_t r, const std::uint64_t* hashes, std::size_t n, double now);
    /// Drops every (replica, block) last touched before now - ttl; returns how many.
    std::size_t expire(double now);

    /// Largest engine block, in router blocks, that set_engine_block accepts.
    static constexpr std::uint64_t kMaxEngineBlock = 65536;
    /// r's engine blocks span k router blocks (C2): match() rounds r's answer down to a
    /// multiple of k. ValueError unless 1 <= k <= kMaxEngineBlock. A retired id resets to 1.
    void set_engine_block(std::int64_t r, std::uint64_t k);
    /// r's k (1 unless set).
    std::uint64_t engine_block(std::int64_t r) const;

    /// r's contents; ages relative to max(now, latest time seen), 0 without capacity or
    /// ttl (then held is in reverse preorder).
    ReplicaContents export_replica(std::int64_t r, double now) const;
    /// ValueError naming the first thing import_replica would refuse in c (its shape, or a
    /// block whose parent differs from the one the index has); changes nothing.
    void check_import(const ReplicaContents& c) const;
    /// Replaces r's contents with c (checked as check_import does, first): held blocks are
    /// refreshed least recent first, last touched age seconds before now; beyond capacity the
    /// least recent are evicted. Returns the blocks r holds.
    std::size_t import_replica(std::int64_t r, const ReplicaContents& c, double now);

    /// The hashes r holds, sorted ascending.
    std::vector<std::uint64_t> held(std::int64_t r) const;
    /// Number of blocks r holds.
    std::size_t blocks(std::int64_t r) const;
    /// Distinct blocks held by at least one replica.
    std::size_t num_blocks() const;
    /// Moves the logged (replica, hash) evictions and expirations out, oldest first.
    void pop_evictions(std::vector<std::int32_t>& replicas, std::vector<std::uint64_t>& hashes);
    /// Counters and sizes.
    PrefixIndexStats stats() const;
    /// Throws StateError naming the first broken invariant of the tree, table or LRU lists.
    void check_invariants() const;

private:
    void match_locked(const std::uint64_t* hashes, std::size_t n, std::vector<std::int32_t>& out) const;
    void check_import_locked(const ReplicaContents& c) const;
    struct Impl;
    std::unique_ptr<Impl> impl_;
};

}  // namespace kvroute
