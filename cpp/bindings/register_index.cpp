// PrefixIndex; the reference twin is python/kvroute/reference/index.py, whose argument
// checks and messages this file reproduces in the same order.
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <cmath>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "gil.hpp"
#include "hashes.hpp"
#include "kvroute/errors.hpp"
#include "kvroute/prefix_index.hpp"
#include "pyargs.hpp"
#include "register.hpp"

namespace py = pybind11;

namespace kvroute::bindings {
namespace {

/// A validated, live replica id (the reference checks it before anything else).
std::int64_t replica_arg(const PrefixIndex& ix, py::handle obj) {
    py::object index = as_index(obj);
    if (!index) throw TypeError("replica must be an int, got " + type_name(obj));
    int overflow = 0;
    const long long r = PyLong_AsLongLongAndOverflow(index.ptr(), &overflow);
    if (r == -1 && PyErr_Occurred()) throw py::error_already_set();
    if (overflow != 0)
        throw IndexError("replica " + py::str(index).cast<std::string>() + " is out of range [0, " +
                         std::to_string(ix.num_replicas()) + ")");
    ix.check_replica(r);
    return r;
}

/// Seconds: None reads the monotonic clock; else a finite int or float.
double now_arg(py::handle obj) {
    if (obj.is_none()) return PrefixIndex::monotonic_now();
    if (PyFloat_CheckExact(obj.ptr())) {
        const double v = PyFloat_AS_DOUBLE(obj.ptr());
        if (!std::isfinite(v)) throw ValueError("now must be finite, got " + py::repr(obj).cast<std::string>());
        return v;
    }
    if (is_bool(obj) || !is_number(obj))
        throw TypeError("now must be a number or None, got " + type_name(obj));
    const double v = PyFloat_AsDouble(obj.ptr());
    if (v == -1.0 && PyErr_Occurred()) throw py::error_already_set();
    if (!std::isfinite(v)) throw ValueError("now must be finite, got " + py::repr(obj).cast<std::string>());
    return v;
}

std::shared_ptr<PrefixIndex> make_index(py::handle num_replicas, py::handle capacity, py::handle ttl,
                                        py::handle record_evictions) {
    py::object n_index = as_index(num_replicas);
    if (!n_index) throw TypeError("num_replicas must be an int, got " + type_name(num_replicas));
    int overflow = 0;
    const long long n = PyLong_AsLongLongAndOverflow(n_index.ptr(), &overflow);
    if (n == -1 && PyErr_Occurred()) throw py::error_already_set();
    if (overflow != 0 || n < 0 || n > static_cast<long long>(PrefixIndex::kMaxReplicas))
        throw ValueError("num_replicas must be in [0, " + std::to_string(PrefixIndex::kMaxReplicas) + "], got " +
                         py::str(n_index).cast<std::string>());
    std::optional<std::uint64_t> cap;
    if (!capacity.is_none()) {
        py::object c_index = as_index(capacity);
        if (!c_index) throw TypeError("capacity must be an int or None, got " + type_name(capacity));
        const long long c = PyLong_AsLongLongAndOverflow(c_index.ptr(), &overflow);
        if (c == -1 && PyErr_Occurred()) throw py::error_already_set();
        if (overflow != 0 || c < 1)
            throw ValueError("capacity must be in [1, 2**63), got " + py::str(c_index).cast<std::string>());
        cap = static_cast<std::uint64_t>(c);
    }
    std::optional<double> t;
    if (!ttl.is_none()) {
        if (is_bool(ttl) || !is_number(ttl))
            throw TypeError("ttl must be a number or None, got " + type_name(ttl));
        const double v = PyFloat_AsDouble(ttl.ptr());
        if (v == -1.0 && PyErr_Occurred()) throw py::error_already_set();
        if (!(std::isfinite(v) && v > 0))
            throw ValueError("ttl must be positive and finite, got " + py::repr(ttl).cast<std::string>());
        t = v;
    }
    if (!is_bool(record_evictions))
        throw TypeError("record_evictions must be a bool, got " + type_name(record_evictions));
    const bool record = PyObject_IsTrue(record_evictions.ptr()) == 1;
    return std::make_shared<PrefixIndex>(static_cast<std::uint32_t>(n), cap, t, record);
}

/// f() with the GIL released when it walks at least kGilHashes hashes (gil.hpp).
template <class F>
auto without_gil_if_long(std::size_t n, F&& f) {
    return without_gil_if(n >= kGilHashes, std::forward<F>(f));
}

template <class T>
py::array_t<T> to_array(const std::vector<T>& v) {
    py::array_t<T> out(static_cast<py::ssize_t>(v.size()));
    if (!v.empty()) std::memcpy(out.mutable_data(), v.data(), v.size() * sizeof(T));
    return out;
}

/// np.asarray(value, dtype) as a vector, 1-D (the reference's _import_arrays: numpy's own
/// conversion errors, then "<name> must be 1-D").
template <class T>
std::vector<T> numpy_vector(py::handle value, const char* name, const char* dtype) {
    refuse_masked(value, name);
    py::object arr = py::module_::import("numpy").attr("asarray")(value, py::arg("dtype") = dtype);
    const auto ndim = arr.attr("ndim").cast<int>();
    if (ndim != 1) throw ValueError(std::string(name) + " must be 1-D, got a " + std::to_string(ndim) + "-D array");
    auto a = py::array_t<T, py::array::c_style | py::array::forcecast>::ensure(arr);
    return std::vector<T>(a.data(), a.data() + a.size());
}

py::tuple export_tuple(const ReplicaContents& c) {
    return py::make_tuple(to_array(c.hashes), to_array(c.parents), to_array(c.held), to_array(c.ages));
}

}  // namespace

void register_index(py::module_& m) {
    py::class_<PrefixIndex, std::shared_ptr<PrefixIndex>>(m, "PrefixIndex", R"doc(
Which replica holds which KV blocks, answering longest-prefix matches for all at once.

A compressed radix tree of chained block hashes with one replica bitset per run of blocks.
Same semantics, results and errors as kvroute.reference.PrefixIndex (see its docstring):
insert/store_after add chains, match counts leading held blocks per replica, remove drops
any blocks, optional capacity (per-replica LRU, deepest blocks first) and ttl (expire).
)doc")
        .def(py::init(&make_index), py::arg("num_replicas") = 0, py::kw_only(), py::arg("capacity") = py::none(),
             py::arg("ttl") = py::none(), py::arg("record_evictions") = false)
        .def_property_readonly("num_replicas", &PrefixIndex::num_replicas,
                               "Number of replica ids, retired ones included (match() returns this many counts).")
        .def_property_readonly("capacity", &PrefixIndex::capacity,
                               "Blocks per replica before its least recent ones are evicted, or None.")
        .def_property_readonly("ttl", &PrefixIndex::ttl, "Seconds a (replica, block) lives without being touched, or None.")
        .def_property_readonly("record_evictions", &PrefixIndex::record_evictions,
                               "Whether evictions and expirations are logged for pop_evictions().")
        .def_property_readonly("num_blocks", &PrefixIndex::num_blocks,
                               "Distinct blocks held by at least one replica (placeholders not counted).")
        .def("add_replica", &PrefixIndex::add_replica,
             "A new replica id: the lowest retired id, else num_replicas (which then grows).")
        .def(
            "remove_replica",
            [](PrefixIndex& ix, py::handle replica) {
                const std::int64_t r = replica_arg(ix, replica);
                py::gil_scoped_release release;  // walks every node
                ix.remove_replica(r);
            },
            py::arg("replica"), "Drop the replica's blocks and retire its id (add_replica() may hand it out again).")
        .def(
            "clear_replica",
            [](PrefixIndex& ix, py::handle replica) {
                const std::int64_t r = replica_arg(ix, replica);
                py::gil_scoped_release release;  // walks every node
                ix.clear_replica(r);
            },
            py::arg("replica"), "Drop every block the replica holds (an engine's AllBlocksCleared); the id stays.")
        .def(
            "clear",
            [](PrefixIndex& ix) {
                py::gil_scoped_release release;  // frees every run
                ix.clear();
            },
            "Drop every block of every replica; replica ids and counters stay.")
        .def(
            "insert",
            [](PrefixIndex& ix, py::handle replica, py::handle hashes, py::handle now) {
                const std::int64_t r = replica_arg(ix, replica);
                const HashView h = as_hashes(hashes);
                const double t = now_arg(now);
                return without_gil_if_long(h.size(), [&] { return ix.insert(r, h.data(), h.size(), t); });
            },
            py::arg("replica"), py::arg("hashes"), py::arg("now") = py::none(),
            "The replica holds the chain `hashes` (block 0 first); returns blocks newly held.")
        .def(
            "store_after",
            [](PrefixIndex& ix, py::handle replica, py::handle parent_hash, py::handle hashes, py::handle now) {
                const std::int64_t r = replica_arg(ix, replica);
                const std::uint64_t parent = as_hash(parent_hash, "parent_hash");
                const HashView h = as_hashes(hashes);
                const double t = now_arg(now);
                return without_gil_if_long(h.size(),
                                           [&] { return ix.store_after(r, parent, h.data(), h.size(), t); });
            },
            py::arg("replica"), py::arg("parent_hash"), py::arg("hashes"), py::arg("now") = py::none(),
            "The replica holds `hashes`, continuing the chain after block `parent_hash`; returns blocks newly "
            "held. KeyError if the parent is not in the index (nothing changes).")
        .def(
            "match",
            [](const PrefixIndex& ix, py::handle hashes) {
                const HashView h = as_hashes(hashes);
                thread_local std::vector<std::int32_t> out;
                without_gil_if_long(h.size(), [&] { ix.match(h.data(), h.size(), out); });
                return to_array(out);
            },
            py::arg("hashes"), "For every replica id, how many leading blocks of `hashes` it holds (int32 array).")
        .def(
            "remove",
            [](PrefixIndex& ix, py::handle replica, py::handle hashes) {
                const std::int64_t r = replica_arg(ix, replica);
                const HashView h = as_hashes(hashes);
                return without_gil_if_long(h.size(), [&] { return ix.remove(r, h.data(), h.size()); });
            },
            py::arg("replica"), py::arg("hashes"),
            "The replica stops holding these blocks (any order); returns how many it held. Hashes it does not "
            "hold are ignored and counted in stats()['unknown_removals'].")
        .def(
            "touch",
            [](PrefixIndex& ix, py::handle replica, py::handle hashes, py::handle now) {
                const std::int64_t r = replica_arg(ix, replica);
                const HashView h = as_hashes(hashes);
                const double t = now_arg(now);
                return without_gil_if_long(h.size(), [&] { return ix.touch(r, h.data(), h.size(), t); });
            },
            py::arg("replica"), py::arg("hashes"), py::arg("now") = py::none(),
            "Refresh the recency of the blocks the replica holds among `hashes`, deepest first. Returns how many "
            "of the hashes it holds (each occurrence counts).")
        .def(
            "expire",
            [](PrefixIndex& ix, py::handle now) {
                const double t = now_arg(now);
                py::gil_scoped_release release;  // drops any number of blocks
                return ix.expire(t);
            },
            py::arg("now") = py::none(), "Drop every (replica, block) last touched before now - ttl; returns how many.")
        .def(
            "held",
            [](const PrefixIndex& ix, py::handle replica) {
                const std::int64_t r = replica_arg(ix, replica);
                std::vector<std::uint64_t> out;
                {
                    py::gil_scoped_release release;  // walks every node
                    out = ix.held(r);
                }
                return to_array(out);
            },
            py::arg("replica"), "The hashes the replica holds, sorted ascending (uint64 array).")
        .def(
            "export_replica",
            [](const PrefixIndex& ix, py::handle replica, py::handle now) {
                const std::int64_t r = replica_arg(ix, replica);
                const double t = now_arg(now);
                ReplicaContents c;
                {
                    py::gil_scoped_release release;  // walks every node
                    c = ix.export_replica(r, t);
                }
                return export_tuple(c);
            },
            py::arg("replica"), py::arg("now") = py::none(),
            "The replica's contents as (hashes, parents, held, ages), for snapshots: held blocks and their "
            "ancestors in depth-first preorder (siblings by hash), parent indices (-1 at the root), held indices "
            "least recent first, seconds since each was touched.")
        .def(
            "import_replica",
            [](PrefixIndex& ix, py::handle replica, py::handle hashes, py::handle parents, py::handle held,
               py::handle ages, py::handle now) {
                const std::int64_t r = replica_arg(ix, replica);
                ReplicaContents c;
                {
                    const HashView h = as_hashes(hashes);
                    c.hashes.assign(h.data(), h.data() + h.size());
                }
                c.parents = numpy_vector<std::int64_t>(parents, "parents", "int64");
                c.held = numpy_vector<std::int64_t>(held, "held", "int64");
                c.ages = numpy_vector<double>(ages, "ages", "float64");
                const double t = now_arg(now);
                py::gil_scoped_release release;  // builds every chain
                return ix.import_replica(r, c, t);
            },
            py::arg("replica"), py::arg("hashes"), py::arg("parents"), py::arg("held"), py::arg("ages"),
            py::arg("now") = py::none(),
            "Replace the replica's contents with an export_replica() result; returns blocks held. Everything is "
            "checked first (ValueError, index unchanged).")
        .def(
            "set_engine_block",
            [](PrefixIndex& ix, py::handle replica, py::handle k) {
                const std::int64_t r = replica_arg(ix, replica);
                py::object index = as_index(k);
                if (!index) throw TypeError("k must be an int, got " + type_name(k));
                int overflow = 0;
                const long long v = PyLong_AsLongLongAndOverflow(index.ptr(), &overflow);
                if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
                if (overflow != 0 || v < 1 || static_cast<unsigned long long>(v) > PrefixIndex::kMaxEngineBlock)
                    throw ValueError("k must be in [1, " + std::to_string(PrefixIndex::kMaxEngineBlock) + "], got " +
                                     py::str(index).cast<std::string>());
                ix.set_engine_block(r, static_cast<std::uint64_t>(v));
            },
            py::arg("replica"), py::arg("k"),
            "The replica's engine blocks span k router blocks: match() rounds its answer down to a multiple of k.")
        .def(
            "engine_block", [](const PrefixIndex& ix, py::handle replica) { return ix.engine_block(replica_arg(ix, replica)); },
            py::arg("replica"), "Router blocks per engine block of the replica (1 unless set).")
        .def(
            "blocks", [](const PrefixIndex& ix, py::handle replica) { return ix.blocks(replica_arg(ix, replica)); },
            py::arg("replica"), "Number of blocks the replica holds.")
        .def(
            "pop_evictions",
            [](PrefixIndex& ix) {
                std::vector<std::int32_t> rs;
                std::vector<std::uint64_t> hs;
                ix.pop_evictions(rs, hs);
                return py::make_tuple(to_array(rs), to_array(hs));
            },
            "The (replica, hash) pairs evicted for capacity or expired since the last call, oldest first, as "
            "(int32 replicas, uint64 hashes); empty unless record_evictions.")
        .def(
            "stats",
            [](const PrefixIndex& ix) {
                PrefixIndexStats s;
                {
                    py::gil_scoped_release release;  // a walk over runs for the byte count
                    s = ix.stats();
                }
                py::dict d;
                d["blocks"] = s.blocks;
                d["placeholders"] = s.placeholders;
                d["nodes"] = s.nodes;
                d["bytes"] = s.bytes;
                d["held"] = s.held;
                d["num_replicas"] = s.num_replicas;
                d["live_replicas"] = s.live_replicas;
                py::list per;
                for (std::uint64_t b : s.replica_blocks) per.append(b);
                d["replica_blocks"] = per;
                d["unknown_removals"] = s.unknown_removals;
                d["evictions"] = s.evictions;
                d["expirations"] = s.expirations;
                d["eviction_log"] = s.eviction_log;
                d["evictions_dropped"] = s.evictions_dropped;
                d["capacity"] = py::cast(ix.capacity());
                d["ttl"] = py::cast(ix.ttl());
                return d;
            },
            "Counters and sizes: blocks, placeholders, nodes, bytes, held pairs, per-replica blocks, ...")
        .def(
            "check_invariants",
            [](const PrefixIndex& ix) {
                py::gil_scoped_release release;  // walks the whole tree
                ix.check_invariants();
            },
            "Raise RuntimeError naming the first broken invariant; None when all hold.")
        .def("__repr__", [](const PrefixIndex& ix) {
            return "PrefixIndex(num_replicas=" + std::to_string(ix.num_replicas()) +
                   ", blocks=" + std::to_string(ix.num_blocks()) + ")";
        });
}

}  // namespace kvroute::bindings
