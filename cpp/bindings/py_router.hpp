// The Python Router object (register_router.cpp), shared with the bindings that add methods to
// it from their own concept's file (register_snapshot.cpp).
#pragma once
#include <pybind11/pybind11.h>

#include <memory>

#include "kvroute/router.hpp"

namespace kvroute::bindings {

/// A Router and the validated RouterConfig it was built from.
struct PyRouter {
    std::shared_ptr<Router> core;  ///< the core router
    pybind11::object config;       ///< kvroute.config.validated(config)
};

/// Router.snapshot and Router.restore (register_snapshot.cpp).
void def_snapshot(pybind11::class_<PyRouter>& cls);

}  // namespace kvroute::bindings
