// EventApplier: mirrors engine KV-cache events (vLLM, SGLang) into a PrefixIndex.
// Twin of python/kvroute/reference/events.py; its module docstring is the contract:
// - apply() decodes one msgpack batch (events_decode.cpp); a payload that does not decode is
//   skipped whole. Every event then applies in order (events_apply.cpp), except that one that
//   cannot be resolved (unknown parent, unknown removal, keys or group or medium it cannot
//   reproduce) is skipped alone and counted by kind.
// - Per replica and KV-cache group, a map engine hash -> entry: its token positions, the
//   kvroute chain state at its end and the router blocks it completes, for engine blocks of
//   any size (pages smaller than a router block are aggregated). Media are a set per entry.
// - The index holds, per replica, the router blocks every group holds; the replica's engine
//   block (in router blocks) is set on the index so that matches round down to it.
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

namespace applier {
struct DecodedReplica;  // events_state.hpp
}  // namespace applier

/// KV-cache groups per replica: events with a group_idx outside [0, kMaxGroups) are skipped.
inline constexpr std::uint64_t kMaxGroups = 64;
/// Distinct medium names an applier tells apart; events naming another are skipped.
inline constexpr std::size_t kMaxMedia = 64;

/// Why an event (or one hash of a removal) was skipped alone.
enum class SkipKind : std::uint8_t { UnknownParent, UnknownRemoval, UnsupportedKeys, UnsupportedGroup, UnsupportedMedium };
/// Number of SkipKind values.
inline constexpr std::size_t kSkipKinds = 5;
/// Names of the skip kinds, as replica_stats reports them.
inline constexpr const char* kSkipKindNames[kSkipKinds] = {
    "unknown_parent", "unknown_removal", "unsupported_keys", "unsupported_group", "unsupported_medium"};

/// Counters of an EventApplier over all replicas.
struct EventApplierStats {
    std::uint64_t batches = 0;             ///< batches decoded and applied
    std::uint64_t events = 0;              ///< understood events
    std::uint64_t ignored_events = 0;      ///< events of unknown types skipped
    std::uint64_t stored_blocks = 0;       ///< (engine block, medium) pairs newly held
    std::uint64_t duplicate_stores = 0;    ///< stores of pairs already held (reuse reports)
    std::uint64_t removed_blocks = 0;      ///< engine blocks removed
    std::uint64_t unknown_removals = 0;    ///< removed hashes not held in that medium/group
    std::uint64_t unknown_parents = 0;     ///< stores skipped for an unknown parent
    std::uint64_t unsupported_events = 0;  ///< events skipped for keys, group or medium
    std::uint64_t clears = 0;              ///< AllBlocksCleared events
    std::uint64_t malformed = 0;           ///< batches skipped whole as malformed
    std::uint64_t index_conflicts = 0;     ///< chains the index refused (evicted parent, conflict)
    std::uint64_t map_evictions = 0;       ///< entries dropped to stay within the index capacity
    std::optional<std::string> last_error;  ///< why the last malformed batch was skipped
};

/// State of one replica in an EventApplier.
struct ReplicaEventStats {
    std::uint64_t batches = 0;          ///< batches applied to it
    std::uint64_t engine_blocks = 0;    ///< engine blocks in its maps (all groups)
    std::uint64_t index_blocks = 0;     ///< kvroute blocks the index holds for it
    std::uint64_t tier_blocks = 0;      ///< kvroute blocks the tier index holds for it
    std::optional<std::uint64_t> engine_block_size;  ///< last engine block size seen
    std::uint64_t engine_block = 1;                  ///< router blocks per engine block (set on the index)
    std::vector<std::uint32_t> groups;               ///< KV-cache groups seen, ascending
    std::uint64_t skipped[kSkipKinds] = {};          ///< events skipped alone, by SkipKind
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
    /// Decodes and applies one batch; false when it was malformed (nothing applied). IndexError
    /// (nothing applied) when r was removed from the index or tier index, also midway.
    bool apply(std::int64_t r, const std::uint8_t* data, std::size_t len);
    /// One BlockStored (group 0, no keys) from arrays; engine_block_size 0 infers it. Returns
    /// its engine blocks. ValueError (token count, medium), KeyError (unknown parent).
    std::size_t apply_stored(std::int64_t r, const std::uint64_t* hashes, std::size_t n,
                             const std::uint64_t* parent, const std::uint32_t* tokens,
                             std::size_t n_tokens, std::size_t engine_block_size,
                             const std::string* medium);
    /// One BlockRemoved from an array; returns engine blocks removed.
    std::size_t apply_removed(std::int64_t r, const std::uint64_t* hashes, std::size_t n,
                              const std::string* medium);
    /// Gives the replica its own salt (null: the applier's again) for chains started later.
    void set_salt(std::int64_t r, const std::string* salt);
    /// Forgets the replica (a resync): maps, blocks in both indexes; salt, counters and the
    /// index's engine block stay.
    void clear_replica(std::int64_t r);

    /// The replica's state (maps, reference counts, own salt, learned sizes, counters) as
    /// bytes import_replica() takes back (docs/snapshot-format.md, "Applier state").
    /// ValueError with a tier index: its contents are not part of a snapshot.
    std::string export_replica(std::int64_t r) const;
    /// Decodes and checks an export_replica() result for this applier (block size, salt,
    /// layout); changes nothing. ValueError naming the problem.
    std::shared_ptr<applier::DecodedReplica> decode_replica(const std::uint8_t* data, std::size_t len) const;
    /// ValueError unless the media these states name fit, with those known, in kMaxMedia.
    void check_media(const std::vector<const applier::DecodedReplica*>& states) const;
    /// Replaces r's state with a decoded one (consumed); the indexes are not touched.
    void install_replica(std::int64_t r, applier::DecodedReplica& state);
    /// decode_replica, check_media and install_replica in one call.
    void import_replica(std::int64_t r, const std::uint8_t* data, std::size_t len);

    /// Counters.
    EventApplierStats stats() const;
    /// One replica's state (zeros for a replica never seen).
    ReplicaEventStats replica_stats(std::int64_t r) const;

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
