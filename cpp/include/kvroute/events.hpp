// EventApplier: mirrors engine KV-cache events (vLLM, SGLang) into a PrefixIndex.
// Twin of python/kvroute/reference/events.py; its module docstring is the contract:
// - apply() decodes one msgpack batch (msgpack.hpp), validates all of it, including that
//   every parent is known, and only then applies it; a malformed batch changes nothing but
//   the malformed counter and last_error.
// - Per replica, a map engine hash -> kvroute hashes (an engine block of E tokens is E /
//   block_size kvroute blocks chained from its parent's last one, or from the salt's root)
//   with reference counts per (engine hash, medium), and per tier a count of engine blocks
//   per kvroute hash. GPU (or no medium) is tier 0 and goes to `index`; any other medium
//   goes to `tier_index` when there is one.
// - An engine block size that is not a multiple of block_size marks the replica unusable
//   (blocks dropped, events ignored, reason reported once) until clear_replica().
// Thread-safe: one mutex per applier; the indexes guard themselves.
#pragma once
#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "kvroute/prefix_index.hpp"

namespace kvroute {

/// Counters of an EventApplier over all replicas.
struct EventApplierStats {
    std::uint64_t batches = 0;           ///< batches applied
    std::uint64_t events = 0;            ///< understood events applied
    std::uint64_t ignored_events = 0;    ///< events of unknown types skipped
    std::uint64_t stored_blocks = 0;     ///< engine blocks stored (duplicates included)
    std::uint64_t removed_blocks = 0;    ///< engine blocks removed
    std::uint64_t unknown_removals = 0;  ///< removals of hashes not held in that medium
    std::uint64_t clears = 0;            ///< AllBlocksCleared events
    std::uint64_t malformed = 0;         ///< batches skipped whole as malformed
    std::uint64_t ignored_batches = 0;   ///< batches of unusable replicas
    std::uint64_t index_conflicts = 0;   ///< chains the index refused (evicted parent, conflict)
    std::optional<std::string> last_error;  ///< why the last malformed batch was skipped
};

/// State of one replica in an EventApplier.
struct ReplicaEventStats {
    std::uint64_t batches = 0;          ///< batches applied to it
    std::uint64_t engine_blocks = 0;    ///< engine hashes in its map
    std::uint64_t index_blocks = 0;     ///< kvroute blocks it holds in the GPU tier
    std::uint64_t tier_blocks = 0;      ///< kvroute blocks it holds in other media
    std::optional<std::uint64_t> engine_block_size;  ///< last engine block size seen
    std::optional<std::string> unusable;             ///< why it is ignored, if it is
    std::optional<double> last_ts;                   ///< engine time of its last batch
    std::string salt;                                ///< bytes its chains start from
};

/// Applies engine KV event batches to PrefixIndex replicas.
class EventApplier {
public:
    /// index: receives GPU blocks; tier_index (may be null): blocks of other media. block_size
    /// in [1, kMaxBlockSize] and salt are the router's.
    EventApplier(std::shared_ptr<PrefixIndex> index, std::size_t block_size, std::string salt,
                 std::shared_ptr<PrefixIndex> tier_index);
    ~EventApplier();
    EventApplier(const EventApplier&) = delete;
    EventApplier& operator=(const EventApplier&) = delete;

    /// IndexError unless r is a live replica id of the index.
    void check_replica(std::int64_t r) const;
    /// Decodes and applies one batch; false when it was malformed (nothing applied).
    bool apply(std::int64_t r, const std::uint8_t* data, std::size_t len);
    /// One BlockStored from arrays; engine_block_size 0 infers it. Returns engine blocks
    /// stored (0 when unusable). ValueError (token count), KeyError (unknown parent).
    std::size_t apply_stored(std::int64_t r, const std::uint64_t* hashes, std::size_t n,
                             const std::uint64_t* parent, const std::uint32_t* tokens,
                             std::size_t n_tokens, std::size_t engine_block_size,
                             const std::string* medium);
    /// One BlockRemoved from an array; returns engine blocks removed.
    std::size_t apply_removed(std::int64_t r, const std::uint64_t* hashes, std::size_t n,
                              const std::string* medium);
    /// Gives the replica its own salt (null: the applier's again) for chains started later.
    void set_salt(std::int64_t r, const std::string* salt);
    /// Forgets the replica: map, blocks in both indexes, unusable mark.
    void clear_replica(std::int64_t r);

    /// Counters.
    EventApplierStats stats() const;
    /// One replica's state (zeros for a replica never seen).
    ReplicaEventStats replica_stats(std::int64_t r) const;
    /// Unusable-replica reports raised since the last call (for the caller to log once).
    std::vector<std::string> take_reports();

    /// Tokens per kvroute block.
    std::size_t block_size() const noexcept;
    /// Salt bytes the chains start from.
    const std::string& salt() const noexcept;
    /// The GPU-tier index.
    const std::shared_ptr<PrefixIndex>& index() const noexcept;
    /// The other-media index (may be null).
    const std::shared_ptr<PrefixIndex>& tier_index() const noexcept;

private:
    struct Impl;
    std::unique_ptr<Impl> impl_;
};

}  // namespace kvroute
