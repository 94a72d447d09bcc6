// The one place that lists the concepts the module registers; each lives in its own file.
#pragma once
#include <pybind11/pybind11.h>

namespace kvroute::bindings {

/// xxh3_64, block_hashes (register_hashing.cpp).
void register_hashing(pybind11::module_& m);
/// PrefixIndex (register_index.cpp).
void register_index(pybind11::module_& m);
/// Router and Decision (register_router.cpp).
void register_router(pybind11::module_& m);
/// Engine KV-event decoding and application (register_events.cpp).
void register_events(pybind11::module_& m);

}  // namespace kvroute::bindings
