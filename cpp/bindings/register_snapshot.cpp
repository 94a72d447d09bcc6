// Router.snapshot and Router.restore; the reference twin is python/kvroute/reference/snapshot.py.
// Arguments and file I/O go through kvroute._snapshot_io, which the reference uses too, so both
// raise the same errors; the core (snapshot.cpp) makes and checks the bytes.
#include <pybind11/stl.h>

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include "kvroute/errors.hpp"
#include "kvroute/events.hpp"
#include "kvroute/prefix_index.hpp"
#include "kvroute/snapshot.hpp"
#include "py_router.hpp"
#include "pyargs.hpp"

namespace py = pybind11;

namespace kvroute::bindings {
namespace {

std::shared_ptr<EventApplier> applier_arg(py::handle h) {
    if (h.is_none()) return nullptr;
    if (!py::isinstance<EventApplier>(h))
        throw TypeError("applier must be an EventApplier or None, got " + type_name(h));
    return h.cast<std::shared_ptr<EventApplier>>();
}

/// The reference's `time.monotonic() if now is None else _now(now)`.
double clock_arg(py::handle h) {
    if (h.is_none()) return PrefixIndex::monotonic_now();
    if (is_bool(h) || !is_number(h)) throw TypeError("now must be a number or None, got " + type_name(h));
    const double v = py::float_(py::reinterpret_borrow<py::object>(h)).cast<double>();
    if (!std::isfinite(v)) throw ValueError("now must be finite, got " + py::repr(h).cast<std::string>());
    return v;
}

double wall_now() { return py::module_::import("time").attr("time")().cast<double>(); }

py::dict snapshot(PyRouter& self, py::handle path, py::handle applier, py::handle cursors, py::handle now) {
    py::module_ io = py::module_::import("kvroute._snapshot_io");
    const std::string p = io.attr("path_arg")(path).cast<std::string>();
    const std::shared_ptr<EventApplier> ap = applier_arg(applier);
    std::vector<SnapshotCursor> curs;
    for (py::handle item : io.attr("cursors_arg")(cursors)) {
        const py::tuple t = py::reinterpret_borrow<py::tuple>(item);
        curs.push_back(SnapshotCursor{t[0].cast<std::string>(), t[1].cast<std::uint64_t>(), t[2].cast<std::uint64_t>()});
    }
    const double t = clock_arg(now);
    const double wall = wall_now();
    SnapshotWritten w;
    {
        py::gil_scoped_release release;  // walks every replica's blocks and maps
        w = encode_snapshot(*self.core, ap.get(), curs, t, wall);
    }
    io.attr("write_atomic")(p, py::bytes(w.bytes));
    py::dict out;
    out["replicas"] = w.replicas;
    out["blocks"] = w.blocks;
    out["sessions"] = w.sessions;
    out["bytes"] = w.bytes.size();
    return out;
}

py::dict restore(PyRouter& self, py::handle path, py::handle applier, py::handle now) {
    py::module_ io = py::module_::import("kvroute._snapshot_io");
    const std::string p = io.attr("path_arg")(path).cast<std::string>();
    const std::shared_ptr<EventApplier> ap = applier_arg(applier);
    const double t = clock_arg(now);
    const py::bytes data = io.attr("read_file")(p);
    const auto* bytes = reinterpret_cast<const std::uint8_t*>(PyBytes_AS_STRING(data.ptr()));
    const auto len = static_cast<std::size_t>(PyBytes_GET_SIZE(data.ptr()));
    SnapshotRestored res;
    {
        py::gil_scoped_release release;  // checks and rebuilds every replica
        res = restore_snapshot(*self.core, ap.get(), bytes, len, t);
    }
    py::dict cursors;
    for (const SnapshotCursor& c : res.cursors) {
        py::dict v;
        v["seq"] = c.seq;
        v["digest"] = c.digest;
        cursors[py::str(c.name)] = v;
    }
    py::dict out;
    out["replicas"] = res.replicas;
    out["blocks"] = res.blocks;
    out["sessions"] = res.sessions;
    out["cursors"] = cursors;
    out["age"] = wall_now() - res.written;
    return out;
}

}  // namespace

void def_snapshot(py::class_<PyRouter>& cls) {
    cls.def("snapshot", &snapshot, py::arg("path"), py::kw_only(), py::arg("applier") = py::none(),
            py::arg("cursors") = py::none(), py::arg("now") = py::none(),
            "Write the index contents, engine blocks, sessions, cursors and, with an applier, its per-replica "
            "state to `path` atomically (contract C7). Returns {'replicas', 'blocks', 'sessions', 'bytes'}.")
        .def("restore", &restore, py::arg("path"), py::kw_only(), py::arg("applier") = py::none(),
             py::arg("now") = py::none(),
             "Load a snapshot (checked whole first: ValueError, nothing changed). Returns {'replicas', 'blocks', "
             "'sessions', 'cursors', 'age'}.");
}

}  // namespace kvroute::bindings
