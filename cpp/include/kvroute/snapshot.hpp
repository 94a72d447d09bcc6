// Router snapshots (contract C7): the bytes of a snapshot file and their restoration. Twin of
// python/kvroute/reference/snapshot.py; the layout is docs/snapshot-format.md. File I/O (the
// atomic write, the size-bounded read) is the binding's, shared with the reference.
#pragma once
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "kvroute/events.hpp"
#include "kvroute/router.hpp"

namespace kvroute {

/// Format version written and read.
inline constexpr std::uint16_t kSnapshotVersion = 1;

/// A subscriber cursor of one replica, passed through a snapshot.
struct SnapshotCursor {
    std::string name;         ///< replica name (UTF-8)
    std::uint64_t seq = 0;    ///< last applied batch number
    std::uint64_t digest = 0; ///< digest of that batch's payload
};

/// What encode_snapshot wrote.
struct SnapshotWritten {
    std::string bytes;                  ///< the file's contents
    std::vector<std::string> replicas;  ///< replica names, in id order
    std::uint64_t blocks = 0;           ///< held blocks over all replicas
    std::uint64_t sessions = 0;         ///< sessions saved
};

/// What restore_snapshot loaded.
struct SnapshotRestored {
    std::vector<std::string> replicas;     ///< replica names in the file
    std::uint64_t blocks = 0;              ///< blocks held after the import, over those replicas
    std::uint64_t sessions = 0;            ///< sessions bound
    std::vector<SnapshotCursor> cursors;   ///< as saved (a repeated name: the last value)
    double written = 0;                    ///< wall-clock seconds (Unix) when written
};

/// ValueError unless `applier` (may be null) feeds router's index, has no tier index and has
/// router's block size.
void check_snapshot_applier(const Router& router, const EventApplier* applier);

/// The snapshot of router (and applier) at `now` (router clock, seconds), stamped `wall_now`
/// (Unix seconds); cursors sorted by name.
SnapshotWritten encode_snapshot(const Router& router, const EventApplier* applier,
                                const std::vector<SnapshotCursor>& cursors, double now, double wall_now);

/// Checks all of data[0, len) (ValueError naming the first problem, nothing changed), then
/// loads it into router (and applier) at `now`.
SnapshotRestored restore_snapshot(Router& router, EventApplier* applier, const std::uint8_t* data, std::size_t len,
                                  double now);

}  // namespace kvroute
