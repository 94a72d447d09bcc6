// EventApplier; the reference twin is python/kvroute/reference/events.py, whose argument
// checks and messages this file reproduces in the same order.
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "gil.hpp"
#include "hashes.hpp"
#include "kvroute/errors.hpp"
#include "kvroute/events.hpp"
#include "kvroute/prefix_index.hpp"
#include "pyargs.hpp"
#include "register.hpp"
#include "tokens.hpp"

namespace py = pybind11;

namespace kvroute::bindings {
namespace {

/// A live replica id of the applier's index, with the index's own errors.
std::int64_t replica_arg(const EventApplier& a, py::handle obj) {
    if (is_bool(obj)) throw TypeError("replica must be an int, got " + type_name(obj));
    PyObject* index = PyNumber_Index(obj.ptr());
    if (index == nullptr) {
        if (!PyErr_ExceptionMatches(PyExc_TypeError)) throw py::error_already_set();
        PyErr_Clear();
        throw TypeError("replica must be an int, got " + type_name(obj));
    }
    const py::object value = py::reinterpret_steal<py::object>(index);
    int overflow = 0;
    const long long r = PyLong_AsLongLongAndOverflow(value.ptr(), &overflow);
    if (r == -1 && PyErr_Occurred()) throw py::error_already_set();
    if (overflow != 0)
        throw IndexError("replica " + py::str(value).cast<std::string>() + " is out of range [0, " +
                         std::to_string(a.index()->num_replicas()) + ")");
    a.check_replica(r);
    return r;
}

std::optional<std::string> medium_arg(py::handle obj) {
    if (obj.is_none()) return std::nullopt;
    if (!PyUnicode_Check(obj.ptr())) throw TypeError("medium must be a str or None, got " + type_name(obj));
    return utf8_arg(obj, "medium");
}

std::shared_ptr<EventApplier> make_applier(py::handle index, py::handle block_size, py::handle salt,
                                           py::handle tier_index) {
    if (!py::isinstance<PrefixIndex>(index))
        throw TypeError("index must be a PrefixIndex, got " + type_name(index));
    std::shared_ptr<PrefixIndex> tier;
    if (!tier_index.is_none()) {
        if (!py::isinstance<PrefixIndex>(tier_index))
            throw TypeError("tier_index must be a PrefixIndex or None, got " + type_name(tier_index));
        tier = tier_index.cast<std::shared_ptr<PrefixIndex>>();
    }
    auto ix = index.cast<std::shared_ptr<PrefixIndex>>();
    if (tier && tier == ix) throw ValueError("tier_index must be a different PrefixIndex than index");
    const std::size_t size = check_block_size(block_size);
    return std::make_shared<EventApplier>(std::move(ix), size, salt_bytes(salt), std::move(tier));
}

template <class T>
py::object optional_obj(const std::optional<T>& v) {
    return v ? py::cast(*v) : py::none();
}

}  // namespace

void register_events(py::module_& m) {
    py::class_<EventApplier, std::shared_ptr<EventApplier>>(m, "EventApplier", R"doc(
Applies one fleet's engine KV events (vLLM, SGLang) to a PrefixIndex, one replica id per engine.

EventApplier(index, block_size=16, *, salt=None, tier_index=None): block_size and salt must be
the router's. GPU blocks go to `index`; blocks of other media to `tier_index` when given. Each
BlockStored's kvroute hashes are recomputed from its token_ids, chained from its parent's;
a repeated store of one (engine hash, medium, group) counts once. A malformed batch is counted
and skipped whole; an event that cannot be resolved is skipped alone. Semantics:
kvroute.reference.events.)doc")
        .def(py::init([](py::handle index, py::handle block_size, py::handle salt, py::handle tier_index) {
                 return make_applier(index, block_size, salt, tier_index);
             }),
             py::arg("index"), py::arg("block_size") = 16, py::kw_only(), py::arg("salt") = py::none(),
             py::arg("tier_index") = py::none())
        .def_property_readonly("block_size", &EventApplier::block_size,
                               "Tokens per kvroute block (the router's block size).")
        .def_property_readonly(
            "salt", [](const EventApplier& a) { return py::bytes(a.salt()); },
            "Bytes of the salt every replica's chains start from.")
        .def_property_readonly(
            "index", [](const EventApplier& a) { return a.index(); }, "The PrefixIndex that GPU blocks go to.")
        .def_property_readonly(
            "tier_index", [](const EventApplier& a) { return a.tier_index(); },
            "The PrefixIndex that blocks of other media go to, or None.")
        .def(
            "apply",
            [](EventApplier& a, py::handle replica, py::handle payload) {
                const std::int64_t r = replica_arg(a, replica);
                py::object keep;
                const char* data = nullptr;
                Py_ssize_t len = 0;
                if (PyBytes_Check(payload.ptr())) {
                    data = PyBytes_AS_STRING(payload.ptr());
                    len = PyBytes_GET_SIZE(payload.ptr());
                    keep = py::reinterpret_borrow<py::object>(payload);
                } else {
                    if (!PyObject_CheckBuffer(payload.ptr()))
                        throw TypeError("payload must be a bytes-like object, got " + type_name(payload));
                    // Any buffer, contiguous or not, read as bytes (what bytes(memoryview(x)) gives).
                    keep = py::reinterpret_steal<py::object>(
                        PyBytes_FromObject(py::memoryview(py::reinterpret_borrow<py::object>(payload)).ptr()));
                    if (!keep) throw py::error_already_set();
                    data = PyBytes_AS_STRING(keep.ptr());
                    len = PyBytes_GET_SIZE(keep.ptr());
                }
                // Decoding and applying loop over the batch; the bytes are pinned by `keep`.
                const auto n = static_cast<std::size_t>(len);
                return without_gil_if(n >= kGilEventBytes,
                                      [&] { return a.apply(r, reinterpret_cast<const std::uint8_t*>(data), n); });
            },
            py::arg("replica"), py::arg("payload"),
            "Decode and apply one msgpack batch; False (counted, nothing applied) when malformed.")
        .def(
            "apply_stored",
            [](EventApplier& a, py::handle replica, py::handle block_hashes, py::handle parent_block_hash,
               py::handle token_ids, py::handle block_size, py::handle medium) {
                const std::int64_t r = replica_arg(a, replica);
                const HashView hs = as_hashes(block_hashes, "block_hashes");
                std::optional<std::uint64_t> parent;
                if (!parent_block_hash.is_none()) parent = as_hash(parent_block_hash, "parent_block_hash");
                const TokenView tokens = tokens_as_uint32(token_ids);
                const std::optional<std::string> med = medium_arg(medium);
                const std::size_t size = block_size.is_none() ? 0 : check_block_size(block_size);
                // Hashing and map updates loop over the blocks; the views pin their arrays.
                return without_gil_if(hs.size() >= kGilHashes || tokens.size() >= kGilTokens, [&] {
                    return a.apply_stored(r, hs.data(), hs.size(), parent ? &*parent : nullptr, tokens.data(),
                                          tokens.size(), size, med ? &*med : nullptr);
                });
            },
            py::arg("replica"), py::arg("block_hashes"), py::arg("parent_block_hash"), py::arg("token_ids"),
            py::kw_only(), py::arg("block_size") = py::none(), py::arg("medium") = py::none(),
            "Apply one BlockStored (group 0, no per-request keys) from arrays; returns its engine blocks.")
        .def(
            "apply_removed",
            [](EventApplier& a, py::handle replica, py::handle block_hashes, py::handle medium) {
                const std::int64_t r = replica_arg(a, replica);
                const HashView hs = as_hashes(block_hashes, "block_hashes");
                const std::optional<std::string> med = medium_arg(medium);
                return without_gil_if(hs.size() >= kGilHashes,  // the view pins its array
                                      [&] { return a.apply_removed(r, hs.data(), hs.size(), med ? &*med : nullptr); });
            },
            py::arg("replica"), py::arg("block_hashes"), py::kw_only(), py::arg("medium") = py::none(),
            "Apply one BlockRemoved from an array of engine hashes; returns blocks removed.")
        .def(
            "set_salt",
            [](EventApplier& a, py::handle replica, py::handle salt) {
                const std::int64_t r = replica_arg(a, replica);
                if (salt.is_none()) return a.set_salt(r, nullptr);
                const std::string bytes = salt_bytes(salt);
                a.set_salt(r, &bytes);
            },
            py::arg("replica"), py::arg("salt"),
            "Give the replica its own salt (None: the applier's again) for chains started later.")
        .def(
            "clear_replica",
            [](EventApplier& a, py::handle replica) {
                const std::int64_t r = replica_arg(a, replica);
                py::gil_scoped_release release;  // drops every block of the replica
                a.clear_replica(r);
            },
            py::arg("replica"), "Forget everything about the replica (a resync): its maps and indexed blocks.")
        .def(
            "export_replica",
            [](const EventApplier& a, py::handle replica) {
                const std::int64_t r = replica_arg(a, replica);
                std::string out;
                {
                    py::gil_scoped_release release;  // walks every entry of the replica
                    out = a.export_replica(r);
                }
                return py::bytes(out);
            },
            py::arg("replica"),
            "The replica's state (maps, reference counts, own salt, learned sizes, counters) as bytes that "
            "import_replica() takes back (docs/snapshot-format.md). ValueError with a tier_index.")
        .def(
            "import_replica",
            [](EventApplier& a, py::handle replica, py::handle state) {
                const std::int64_t r = replica_arg(a, replica);
                if (!PyBytes_Check(state.ptr()) && !PyByteArray_Check(state.ptr()) && !PyMemoryView_Check(state.ptr()))
                    throw TypeError("state must be bytes, got " + type_name(state));
                const std::string data = py::module_::import("builtins").attr("bytes")(state).cast<std::string>();
                py::gil_scoped_release release;  // rebuilds every entry of the replica
                a.import_replica(r, reinterpret_cast<const std::uint8_t*>(data.data()), data.size());
            },
            py::arg("replica"), py::arg("state"),
            "Replace the replica's state with an export_replica() result; the index is not touched. ValueError "
            "(nothing changed) when the state is cut short, malformed, or for another block size or salt.")
        .def(
            "stats",
            [](const EventApplier& a) {
                const EventApplierStats s = a.stats();
                py::dict d;
                d["batches"] = s.batches;
                d["events"] = s.events;
                d["ignored_events"] = s.ignored_events;
                d["stored_blocks"] = s.stored_blocks;
                d["duplicate_stores"] = s.duplicate_stores;
                d["removed_blocks"] = s.removed_blocks;
                d["unknown_removals"] = s.unknown_removals;
                d["unknown_parents"] = s.unknown_parents;
                d["unsupported_events"] = s.unsupported_events;
                d["clears"] = s.clears;
                d["malformed"] = s.malformed;
                d["index_conflicts"] = s.index_conflicts;
                d["map_evictions"] = s.map_evictions;
                d["last_error"] = optional_obj(s.last_error);
                return d;
            },
            "Counters over all replicas and last_error (the last malformed batch's message).")
        .def(
            "replica_stats",
            [](const EventApplier& a, py::handle replica) {
                const ReplicaEventStats s = a.replica_stats(replica_arg(a, replica));
                py::dict d;
                d["batches"] = s.batches;
                d["engine_blocks"] = s.engine_blocks;
                d["index_blocks"] = s.index_blocks;
                d["tier_blocks"] = s.tier_blocks;
                d["engine_block_size"] = optional_obj(s.engine_block_size);
                d["engine_block"] = s.engine_block;
                py::list groups;
                for (const std::uint32_t g : s.groups) groups.append(g);
                d["groups"] = groups;
                py::dict skipped;
                for (std::size_t k = 0; k < kSkipKinds; ++k) skipped[kSkipKindNames[k]] = s.skipped[k];
                d["skipped"] = skipped;
                d["last_ts"] = optional_obj(s.last_ts);
                d["salt"] = py::bytes(s.salt);
                return d;
            },
            py::arg("replica"),
            "One replica: batches, engine_blocks, index_blocks, tier_blocks, engine_block_size, "
            "engine_block, groups, skipped (by kind), last_ts, salt.")
        .def("__repr__", [](const EventApplier& a) {
            return "EventApplier(block_size=" + std::to_string(a.block_size()) + ")";
        });
}

}  // namespace kvroute::bindings
