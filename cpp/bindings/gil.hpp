// When a native call lets go of the GIL.
//
// A call that releases the GIL has to win it back before it returns. While another Python
// thread is running, that thread keeps the GIL until the interpreter's switch interval
// (sys.getswitchinterval(), 5 ms) makes it hand over, so each release can cost the caller up
// to 5 ms: the convoy effect. benchmarks/bench_gil.py measures it next to one busy Python
// thread: route() of an 8,192-token prompt and a little Python took 1.06 ms per call on
// average when route() released the GIL on every call, and 6.5 us when it keeps it (6.9 us
// with no other thread). A gateway routes on its event loop while subscriber, state and
// snapshot threads run Python, and a subscriber applies events while the event loop runs
// Python; so a call keeps the GIL unless its work is long. Each threshold below is where
// the work reaches the order of a millisecond on the dev machine: past it, holding the GIL
// would stall the other threads about as long as a hand-over may cost the caller.
#pragma once
#include <pybind11/pybind11.h>

#include <atomic>
#include <cstddef>

namespace kvroute::bindings {

/// Tokens hashed (route, block_hashes, apply_stored's token ids), ~0.3 ns each: 1 Mi, ~0.3 ms.
inline constexpr std::size_t kGilTokens = std::size_t{1} << 20;
/// Block hashes given to the index or the event applier (route_hashes, observe_route, PrefixIndex
/// calls, apply_stored, apply_removed): 16 Ki, from ~30 us along one run of the radix tree to
/// ~1.6 ms when each is a map update (~100 ns: the applier's removals).
inline constexpr std::size_t kGilHashes = std::size_t{1} << 14;
/// Bytes hashed by xxh3_64, ~0.03 ns each: 32 MiB, ~1 ms.
inline constexpr std::size_t kGilBytes = std::size_t{1} << 25;
/// Bytes of one msgpack event batch, decoded and applied at 2.5 to 11 ns each: 128 KiB, 0.3 to 1.4 ms.
inline constexpr std::size_t kGilEventBytes = std::size_t{1} << 17;

/// Set by _native._release_gil_always(True): every call below releases the GIL whatever its size,
/// so that threaded tests run native code in several threads at once (what ThreadSanitizer
/// checks). Off by default.
inline std::atomic<bool> release_gil_always{false};

/// f() with the GIL released when `is_long` (or always, see above); f must touch no Python object.
template <class F>
auto without_gil_if(bool is_long, F&& f) {
    if (!is_long && !release_gil_always.load(std::memory_order_relaxed)) return f();
    pybind11::gil_scoped_release release;
    return f();
}

}  // namespace kvroute::bindings
