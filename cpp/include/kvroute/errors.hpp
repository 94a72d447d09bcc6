// Typed errors of the core, one per Python exception type they become (module.cpp maps them).
// User input is checked at the boundary with these; internal invariants use KVROUTE_DCHECK.
#pragma once
#include <cstdio>
#include <cstdlib>
#include <stdexcept>
#include <string>

namespace kvroute {

/// Bad value (wrong range, wrong shape): Python ValueError.
struct ValueError : std::invalid_argument {
    using std::invalid_argument::invalid_argument;
};
/// Bad type (wrong dtype, wrong kind of object): Python TypeError.
struct TypeError : std::invalid_argument {
    using std::invalid_argument::invalid_argument;
};
/// Unknown id or position (replica id, handle): Python IndexError.
struct IndexError : std::out_of_range {
    using std::out_of_range::out_of_range;
};
/// Unknown key (block hash, replica name, session): Python KeyError.
struct KeyError : std::runtime_error {
    using std::runtime_error::runtime_error;
};
/// Operation not valid in the current state (finish twice, drained replica): Python RuntimeError.
struct StateError : std::runtime_error {
    using std::runtime_error::runtime_error;
};

}  // namespace kvroute

#ifdef KVROUTE_DEBUG
/// Internal invariant, checked only in debug/sanitizer builds.
#define KVROUTE_DCHECK(cond)                                                              \
    do {                                                                                  \
        if (!(cond)) {                                                                    \
            std::fprintf(stderr, "kvroute: invariant failed: %s (%s:%d)\n", #cond, __FILE__, \
                         __LINE__);                                                       \
            std::abort();                                                                 \
        }                                                                                 \
    } while (0)
#else
#define KVROUTE_DCHECK(cond) ((void)0)
#endif
