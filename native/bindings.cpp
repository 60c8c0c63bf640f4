// The only pybind11 file: exposes the C++ core as pagedinfer._native.
//
// Threading: every call takes the manager's mutex; bulk calls release the GIL first. The mutex is
// never held while acquiring the GIL, so the two locks cannot deadlock.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "pagedinfer/block_manager.h"
#include "pagedinfer/version.h"

namespace py = pybind11;
namespace pi = pagedinfer;

namespace {

// Work sizes from which a call releases the GIL. Below them the call takes a few microseconds,
// and handing the GIL over could stall this thread for a whole switch interval (5 ms) behind
// another busy Python thread.
constexpr int64_t kBulkTokens = 1024;
constexpr int64_t kBulkSequences = 128;

// A 1-D integer argument as a contiguous buffer: a view of a matching C-contiguous NumPy array,
// else a checked copy (lists, tuples, other integer dtypes). Floats and out-of-range values raise.
template <typename T>
class IntArray {
 public:
  IntArray(py::handle obj, const char* name) {
    if (PyList_Check(obj.ptr()) || PyTuple_Check(obj.ptr())) {
      from_sequence(obj, name);
      return;
    }
    using Exact = py::array_t<T, py::array::c_style>;
    if (Exact::check_(obj)) {
      auto array = py::reinterpret_borrow<Exact>(obj);
      if (array.ndim() != 1) throw py::value_error(std::string(name) + " must be 1-D");
      keep_ = array;
      data_ = array.data();
      size_ = array.size();
      return;
    }
    from_array(obj, name);
  }
  IntArray(const IntArray&) = delete;
  IntArray& operator=(const IntArray&) = delete;
  const T* data() const { return data_; }
  int64_t size() const { return size_; }

 private:
  static T checked(long long value, const char* name) {
    if (value < std::numeric_limits<T>::min() || value > std::numeric_limits<T>::max()) {
      throw py::value_error(std::string(name) + " value " + std::to_string(value) +
                            " is out of range");
    }
    return static_cast<T>(value);
  }
  // Short inputs (one decode token) stay in the object: no heap allocation per call.
  T* allocate(int64_t n) {
    size_ = n;
    if (n <= kInline) return data_ = inline_, inline_;
    storage_.resize(n);
    data_ = storage_.data();
    return storage_.data();
  }
  void from_sequence(py::handle obj, const char* name) {
    Py_ssize_t n = PySequence_Fast_GET_SIZE(obj.ptr());
    PyObject** items = PySequence_Fast_ITEMS(obj.ptr());
    T* out = allocate(n);
    for (Py_ssize_t i = 0; i < n; ++i) {
      if (!PyLong_Check(items[i])) {  // NumPy integer scalars and other __index__ types
        out[i] = checked(py::reinterpret_borrow<py::object>(items[i])
                             .attr("__index__")()
                             .template cast<long long>(),
                         name);
        continue;
      }
      int overflow = 0;
      long long value = PyLong_AsLongLongAndOverflow(items[i], &overflow);
      if (overflow != 0) throw py::value_error(std::string(name) + " value is out of range");
      out[i] = checked(value, name);
    }
  }
  void from_array(py::handle obj, const char* name) {
    py::module_ np = py::module_::import("numpy");
    py::array array = np.attr("asarray")(obj);
    if (array.ndim() != 1) throw py::value_error(std::string(name) + " must be 1-D");
    char kind = array.dtype().kind();
    if (array.size() > 0 && kind != 'i' && kind != 'u') {
      throw py::type_error(std::string(name) + " must hold integers");
    }
    auto wide = py::array_t<long long, py::array::c_style | py::array::forcecast>::ensure(array);
    T* out = allocate(wide.size());
    for (py::ssize_t i = 0; i < wide.size(); ++i) out[i] = checked(wide.data()[i], name);
  }

  static constexpr int64_t kInline = 16;
  py::object keep_;
  T inline_[kInline];
  std::vector<T> storage_;
  const T* data_ = nullptr;
  int64_t size_ = 0;
};

py::array_t<int32_t> to_numpy(const std::vector<int32_t>& values) {
  py::array_t<int32_t> out(static_cast<py::ssize_t>(values.size()));
  std::copy(values.begin(), values.end(), out.mutable_data());
  return out;
}

py::list to_list(const std::optional<pi::BlockCopy>& copied) {
  py::list out;
  if (copied) out.append(py::make_tuple(copied->src, copied->dst));
  return out;
}

// Python-facing view of one step's batch arrays; they share one owner, no copies.
struct PyBatchArrays {
  py::array block_tables, slot_mapping, positions, context_lens, query_start_loc;
};

PyBatchArrays wrap(pi::BatchArrays&& batch) {
  auto holder = std::make_unique<pi::BatchArrays>(std::move(batch));
  pi::BatchArrays* owned = holder.get();
  py::capsule owner(owned, [](void* p) { delete static_cast<pi::BatchArrays*>(p); });
  holder.release();  // the capsule owns it now
  auto view = [&](const pi::Int32Buffer& buf, std::vector<py::ssize_t> shape) {
    return py::array(py::dtype::of<int32_t>(), std::move(shape), buf.data.get(), owner);
  };
  return {view(owned->block_tables, {owned->batch, owned->max_blocks}),
          view(owned->slot_mapping, {owned->slot_mapping.size}),
          view(owned->positions, {owned->positions.size}),
          view(owned->context_lens, {owned->batch}),
          view(owned->query_start_loc, {owned->batch + 1})};
}

// The core plus the lock that serialises access to it.
class PyBlockManager {
 public:
  PyBlockManager(int32_t num_blocks, int32_t block_size, bool enable_prefix_caching)
      : core_(num_blocks, block_size, enable_prefix_caching) {}

  // Runs fn(core) under the mutex, with the GIL released when `bulk`.
  template <typename Fn>
  auto locked(bool bulk, Fn&& fn) {
    std::optional<py::gil_scoped_release> release;
    if (bulk) release.emplace();
    std::lock_guard<std::mutex> lock(mutex_);
    return fn(core_);
  }

  int64_t add_sequence(int64_t seq_id, py::handle tokens) {
    IntArray<int32_t> ids(tokens, "token_ids");
    return locked(ids.size() >= kBulkTokens, [&](pi::BlockManager& c) {
      return c.add_sequence(seq_id, ids.data(), ids.size());
    });
  }
  py::list append_tokens(int64_t seq_id, py::handle tokens) {
    IntArray<int32_t> ids(tokens, "token_ids");
    return to_list(locked(ids.size() >= kBulkTokens, [&](pi::BlockManager& c) {
      return c.append_tokens(seq_id, ids.data(), ids.size());
    }));
  }
  py::list append_tokens_batch(py::handle seq_ids, py::handle token_ids, py::handle num_tokens) {
    IntArray<int64_t> ids(seq_ids, "seq_ids");
    IntArray<int32_t> tokens(token_ids, "token_ids");
    IntArray<int32_t> counts(num_tokens, "num_tokens");
    if (ids.size() != counts.size())
      throw py::value_error("seq_ids and num_tokens differ in length");
    bool bulk = ids.size() >= kBulkSequences || tokens.size() >= kBulkTokens;
    std::vector<pi::BlockCopy> copies = locked(bulk, [&](pi::BlockManager& c) {
      return c.append_tokens_batch(ids.data(), counts.data(), ids.size(), tokens.data(),
                                   tokens.size());
    });
    py::list out;
    for (const auto& copy : copies) out.append(py::make_tuple(copy.src, copy.dst));
    return out;
  }
  int64_t blocks_needed_to_append_batch(py::handle seq_ids, py::handle num_tokens) {
    IntArray<int64_t> ids(seq_ids, "seq_ids");
    IntArray<int32_t> counts(num_tokens, "num_tokens");
    if (ids.size() != counts.size())
      throw py::value_error("seq_ids and num_tokens differ in length");
    return locked(ids.size() >= kBulkSequences, [&](pi::BlockManager& c) {
      return c.blocks_needed_to_append_batch(ids.data(), counts.data(), ids.size());
    });
  }
  void set_last_tokens(py::handle seq_ids, py::handle token_ids) {
    IntArray<int64_t> ids(seq_ids, "seq_ids");
    IntArray<int32_t> tokens(token_ids, "token_ids");
    if (ids.size() != tokens.size())
      throw py::value_error("seq_ids and token_ids differ in length");
    locked(ids.size() >= kBulkSequences,
           [&](pi::BlockManager& c) { c.set_last_tokens(ids.data(), tokens.data(), ids.size()); });
  }
  void set_tokens(int64_t seq_id, int64_t start, py::handle token_ids) {
    IntArray<int32_t> tokens(token_ids, "token_ids");
    locked(tokens.size() >= kBulkTokens,
           [&](pi::BlockManager& c) { c.set_tokens(seq_id, start, tokens.data(), tokens.size()); });
  }
  void mark_computed(py::handle seq_ids, py::handle num_computed) {
    IntArray<int64_t> ids(seq_ids, "seq_ids");
    IntArray<int32_t> nums(num_computed, "num_computed_tokens");
    if (ids.size() != nums.size()) throw py::value_error("seq_ids and counts differ in length");
    locked(ids.size() >= kBulkSequences,
           [&](pi::BlockManager& c) { c.mark_computed(ids.data(), nums.data(), ids.size()); });
  }
  PyBatchArrays build_batch(py::handle seq_ids, py::handle num_computed, py::handle num_new,
                            std::optional<int64_t> max_blocks) {
    IntArray<int64_t> ids(seq_ids, "seq_ids");
    IntArray<int32_t> computed(num_computed, "num_computed_tokens");
    IntArray<int32_t> fresh(num_new, "num_new_tokens");
    if (ids.size() != computed.size() || ids.size() != fresh.size()) {
      throw py::value_error("seq_ids, num_computed_tokens and num_new_tokens differ in length");
    }
    if (max_blocks && *max_blocks < 0) throw py::value_error("max_blocks must be >= 0");
    bool bulk = ids.size() >= kBulkSequences;
    return wrap(locked(bulk, [&](pi::BlockManager& c) {
      return c.build_batch(ids.data(), computed.data(), fresh.data(), ids.size(),
                           max_blocks.value_or(-1));
    }));
  }
  py::dict stats();

  std::mutex mutex_;
  pi::BlockManager core_;
};

py::dict PyBlockManager::stats() {
  pi::BlockManagerStats s = locked(true, [](pi::BlockManager& c) { return c.stats(); });
  double used_slots = static_cast<double>(s.used_blocks) * core_.block_size();
  py::dict d;
  d["total_blocks"] = s.total_blocks;
  d["free_blocks"] = s.free_blocks;
  d["used_blocks"] = s.used_blocks;
  d["cached_blocks"] = s.cached_blocks;
  d["available_blocks"] = s.free_blocks + s.cached_blocks;
  d["occupancy"] = static_cast<double>(s.used_blocks) / s.total_blocks;
  d["stored_tokens"] = s.stored_tokens;
  d["fragmentation_ratio"] = s.used_blocks > 0 ? 1.0 - s.stored_tokens / used_slots : 0.0;
  d["prefix_cache_hits"] = s.prefix_cache_hits;
  d["prefix_cache_queries"] = s.prefix_cache_queries;
  d["prefix_cache_hit_rate"] =
      s.prefix_cache_queries > 0
          ? static_cast<double>(s.prefix_cache_hits) / static_cast<double>(s.prefix_cache_queries)
          : 0.0;
  d["cow_copies"] = s.cow_copies;
  d["evictions"] = s.evictions;
  d["num_sequences"] = s.num_sequences;
  return d;
}

}  // namespace

PYBIND11_MODULE(_native, m) {
  m.doc() = "paged-infer native paged KV-cache core";
  m.def("version", &pi::version);

  py::register_exception<pi::OutOfBlocksError>(m, "OutOfBlocksError", PyExc_RuntimeError);
  // Unknown ids are both a KeyError (mapping semantics) and a ValueError (bad argument).
  static py::exception<pi::UnknownSequenceError> unknown(
      m, "UnknownSequenceError",
      py::make_tuple(py::handle(PyExc_KeyError), py::handle(PyExc_ValueError)));
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const pi::UnknownSequenceError& e) {
      py::set_error(unknown, e.what());
    }
  });
  py::register_exception<pi::DuplicateSequenceError>(m, "DuplicateSequenceError", PyExc_ValueError);
  py::register_exception<pi::InvariantError>(m, "InvariantError", PyExc_AssertionError);

  py::class_<PyBatchArrays>(m, "BatchArrays", "Inputs of one engine step (int32 NumPy arrays).")
      .def_readonly("block_tables", &PyBatchArrays::block_tables, "[batch, max_blocks], pad 0")
      .def_readonly("slot_mapping", &PyBatchArrays::slot_mapping, "[num_new_tokens]")
      .def_readonly("positions", &PyBatchArrays::positions, "[num_new_tokens]")
      .def_readonly("context_lens", &PyBatchArrays::context_lens, "[batch]")
      .def_readonly("query_start_loc", &PyBatchArrays::query_start_loc, "[batch + 1]")
      .def("__repr__", [](const PyBatchArrays& b) {
        return "BatchArrays(batch=" + std::to_string(b.context_lens.size()) +
               ", num_new_tokens=" + std::to_string(b.slot_mapping.size()) + ")";
      });

  using M = PyBlockManager;
  using Guard = std::lock_guard<std::mutex>;
  py::class_<M>(m, "BlockManager",
                "Paged KV-cache block manager: block pool, page tables, copy-on-write and "
                "automatic prefix caching. Deals only in block ids and slots.")
      .def(py::init<int32_t, int32_t, bool>(), py::arg("num_blocks"), py::arg("block_size"),
           py::arg("enable_prefix_caching") = true)
      .def("add_sequence", &M::add_sequence, py::arg("seq_id"), py::arg("token_ids"))
      .def("append_tokens", &M::append_tokens, py::arg("seq_id"), py::arg("token_ids"))
      .def("append_tokens_batch", &M::append_tokens_batch, py::arg("seq_ids"), py::arg("token_ids"),
           py::arg("num_tokens"),
           "append_tokens for many sequences in one call (all or nothing); returns all copies.")
      .def(
          "blocks_needed_to_append",
          [](M& self, int64_t id, int64_t n) {
            Guard g(self.mutex_);
            return self.core_.blocks_needed_to_append(id, n);
          },
          py::arg("seq_id"), py::arg("num_tokens"))
      .def("blocks_needed_to_append_batch", &M::blocks_needed_to_append_batch, py::arg("seq_ids"),
           py::arg("num_tokens"),
           "Exact blocks append_tokens_batch would take for these counts (ids distinct).")
      .def(
          "fork",
          [](M& self, int64_t parent, int64_t child) {
            Guard g(self.mutex_);
            self.core_.fork(parent, child);
          },
          py::arg("parent_id"), py::arg("child_id"))
      .def(
          "truncate",
          [](M& self, int64_t id, int64_t n) {
            Guard g(self.mutex_);
            self.core_.truncate(id, n);
            return py::list();  // copy-on-write is deferred to the next append
          },
          py::arg("seq_id"), py::arg("num_tokens"))
      .def(
          "free",
          [](M& self, int64_t id) {
            Guard g(self.mutex_);
            self.core_.free(id);
          },
          py::arg("seq_id"))
      .def("set_last_tokens", &M::set_last_tokens, py::arg("seq_ids"), py::arg("token_ids"),
           "Replace each sequence's last token (a placeholder appended before its id was known).")
      .def("set_tokens", &M::set_tokens, py::arg("seq_id"), py::arg("start"), py::arg("token_ids"),
           "Overwrite the recorded ids at positions [start, start + len(token_ids)) in place "
           "(placeholders of an asynchronous step); blocks never move.")
      .def("mark_computed", &M::mark_computed, py::arg("seq_ids"), py::arg("num_computed_tokens"))
      .def(
          "can_allocate",
          [](M& self, int64_t n) {
            Guard g(self.mutex_);
            return self.core_.can_allocate(n);
          },
          py::arg("num_tokens"))
      .def(
          "has_sequence",
          [](M& self, int64_t id) {
            Guard g(self.mutex_);
            return self.core_.has_sequence(id);
          },
          py::arg("seq_id"))
      .def(
          "num_tokens",
          [](M& self, int64_t id) {
            Guard g(self.mutex_);
            return static_cast<int64_t>(self.core_.sequence(id).tokens.size());
          },
          py::arg("seq_id"))
      .def(
          "token_ids",
          [](M& self, int64_t id) {
            Guard g(self.mutex_);
            return to_numpy(self.core_.sequence(id).tokens);
          },
          py::arg("seq_id"))
      .def(
          "block_table",
          [](M& self, int64_t id) {
            Guard g(self.mutex_);
            return to_numpy(self.core_.sequence(id).blocks);
          },
          py::arg("seq_id"))
      .def("build_batch", &M::build_batch, py::arg("seq_ids"), py::arg("num_computed_tokens"),
           py::arg("num_new_tokens"), py::arg("max_blocks") = py::none())
      .def("stats", &M::stats)
      .def("check_invariants",
           [](M& self) { self.locked(true, [](pi::BlockManager& c) { c.check_invariants(); }); })
      .def(
          "block_refcount",
          [](M& self, int32_t block) {
            Guard g(self.mutex_);
            return self.core_.block_refcount(block);
          },
          py::arg("block_id"))
      .def(
          "block_tokens",
          [](M& self, int32_t block) {
            Guard g(self.mutex_);
            const int32_t* data = self.core_.block_tokens(block);
            return to_numpy(std::vector<int32_t>(data, data + self.core_.block_size()));
          },
          py::arg("block_id"), "The block_size token ids stored in a block (for tests).")
      .def_property_readonly("num_free_blocks",
                             [](M& self) {
                               Guard g(self.mutex_);
                               return self.core_.num_free_blocks();
                             })
      .def_property_readonly("num_total_blocks",
                             [](M& self) { return self.core_.num_total_blocks(); })
      .def_property_readonly("block_size", [](M& self) { return self.core_.block_size(); })
      .def_property_readonly("enable_prefix_caching",
                             [](M& self) { return self.core_.enable_prefix_caching(); });
}
