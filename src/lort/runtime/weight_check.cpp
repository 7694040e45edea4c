// lort's frozen-weight check in C++ (runtime/frozen.py's WeightGuard.same_picked, the
// same test): the tensors passed are the objects frozen, with the version counters and
// data pointers they had then, and each sampled element still holds its bits.
//
// Python reads each tensor through several attribute calls, one after the other; right
// after an ORT run the tensors' objects, TensorImpls, version counters and storages are
// out of the caches, and each read waits for memory. This loop reads them in passes
// (objects, then TensorImpls, then counters and storages, then samples), prefetching the
// next level for every tensor before reading any of it, so the misses overlap.
//
// Built by runtime/native.py (`python -m lort.runtime.build_native`) against the torch it runs
// with; where it is not built, runtime/frozen.py checks in Python.

#include <torch/csrc/autograd/python_variable.h>

#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <vector>

namespace {

struct Sample {
  int64_t offset;  // bytes from the storage's start
  int64_t size;    // bytes (1, 2, 4 or 8); 0: not sampled
  uint64_t bits;   // the element's bytes when frozen, read as memcpy reads them
};

class WeightCheck {
 public:
  WeightCheck(py::sequence tensors, std::vector<int64_t> offsets, std::vector<int64_t> sizes,
              std::vector<uint64_t> bits) {
    const size_t n = py::len(tensors);
    if (offsets.size() != n || sizes.size() != n || bits.size() != n) {
      throw std::invalid_argument("one sample (offset, size, bits) per tensor");
    }
    for (size_t i = 0; i < n; i++) {
      py::object obj = tensors[i];
      if (!THPVariable_Check(obj.ptr())) {
        throw std::invalid_argument("not a tensor");
      }
      c10::TensorImpl* impl = THPVariable_Unpack(obj.ptr()).unsafeGetTensorImpl();
      if (!impl->has_storage() || !impl->version_counter().enabled()) {
        throw std::invalid_argument("a tensor without storage or version counter");
      }
      if (sizes[i] < 0 || sizes[i] > 8 || offsets[i] < 0 ||
          (sizes[i] > 0 && static_cast<size_t>(offsets[i] + sizes[i]) > impl->unsafe_storage().nbytes())) {
        throw std::invalid_argument("a sample outside the tensor's storage");
      }
      objects_.push_back(obj);
      versions_.push_back(impl->version_counter().current_version());
      data_.push_back(impl->unsafe_storage().data());
      storage_offsets_.push_back(impl->storage_offset());
      samples_.push_back(Sample{offsets[i], sizes[i], bits[i]});
    }
    impls_.resize(n);
  }

  // Whether ``picked`` (a tuple or list) holds the frozen tensors, unchanged.
  bool same(py::handle picked) {
    PyObject** items = this->items(picked);
    return items != nullptr && first_change(items) < 0;
  }

  // Where each tensor is read from on a call (``same_registered``): ``dicts[i][keys[i]]``
  // (a module's ``_parameters`` or ``_buffers``). Each key's entry is found now, and its
  // place in the dict's entry table kept with the dict's own key object.
  void set_registries(py::list dicts, py::list keys) {
    const size_t n = objects_.size();
    if (py::len(dicts) != n || py::len(keys) != n) {
      throw std::invalid_argument("one registry (dict, key) per tensor");
    }
    for (size_t i = 0; i < n; i++) {
      if (!PyDict_CheckExact(dicts[i].ptr())) {
        throw std::invalid_argument("a registry that is not a dict");
      }
    }
    dicts_.clear();
    keys_.clear();
    for (size_t i = 0; i < n; i++) {
      dicts_.push_back(dicts[i]);
      keys_.push_back(keys[i]);
    }
    places_.assign(n, -1);
    registered_.resize(n);
    for (size_t i = 0; i < n; i++) {
      if (locate(i) == nullptr && PyErr_Occurred()) {
        throw py::error_already_set();
      }
    }
  }

  // Whether each registry still holds its frozen tensor, unchanged (false where a key is
  // missing: the caller's full path says so). Each key is first looked for at its place
  // in the dict's entry table, without hashing (PyDict_Next from there gives the first
  // entry at or after it that is not deleted): the entry holding the dict's key object
  // is that key's only entry, so its value is ``dicts[i][keys[i]]``. Where the place
  // holds another entry (the dict was rebuilt, the key removed or inserted again), the
  // key is found again by a scan of the dict.
  bool same_registered() {
    const size_t n = objects_.size();
    if (dicts_.size() != n) {
      throw std::logic_error("set_registries was not called");
    }
    for (size_t i = 0; i < n; i++) {
      __builtin_prefetch(dicts_[i].ptr());
    }
    for (size_t i = 0; i < n; i++) {
      __builtin_prefetch(reinterpret_cast<PyDictObject*>(dicts_[i].ptr())->ma_keys);
    }
    for (size_t i = 0; i < n; i++) {
      Py_ssize_t pos = places_[i];
      PyObject *key, *value;  // borrowed
      if (pos < 0 || !PyDict_Next(dicts_[i].ptr(), &pos, &key, &value) || key != keys_[i].ptr()) {
        value = locate(i);
        if (value == nullptr) {
          PyErr_Clear();
          return false;
        }
      }
      registered_[i] = value;
    }
    return n == 0 || first_change(registered_.data()) < 0;
  }

  // The index of the first tensor of ``picked`` that changed (checked as ``same`` checks:
  // identities, then versions and data, then samples), or -1.
  int64_t first_change_of(py::handle picked) {
    PyObject** items = this->items(picked);
    if (items == nullptr) {
      throw std::invalid_argument("not a tuple or list of as many tensors as were frozen");
    }
    return first_change(items);
  }

 private:
  PyObject** items(py::handle picked) {
    PyObject* seq = picked.ptr();
    const size_t n = objects_.size();
    if (PyTuple_Check(seq) && static_cast<size_t>(PyTuple_GET_SIZE(seq)) == n) {
      return n == 0 ? &none_ : &PyTuple_GET_ITEM(seq, 0);
    }
    if (PyList_Check(seq) && static_cast<size_t>(PyList_GET_SIZE(seq)) == n) {
      return n == 0 ? &none_ : &PyList_GET_ITEM(seq, 0);
    }
    return nullptr;
  }

  int64_t first_change(PyObject** items) {
    const size_t n = objects_.size();
    for (size_t i = 0; i < n; i++) {
      if (items[i] != objects_[i].ptr()) {
        return static_cast<int64_t>(i);
      }
      __builtin_prefetch(items[i]);
    }
    // The objects are the frozen ones, so tensors; their TensorImpls may still have been
    // swapped (torch.utils.swap_tensors), so each is read again.
    for (size_t i = 0; i < n; i++) {
      c10::TensorImpl* impl = THPVariable_Unpack(items[i]).unsafeGetTensorImpl();
      impls_[i] = impl;
      __builtin_prefetch(impl);
      __builtin_prefetch(reinterpret_cast<const char*>(impl) + 64);
      __builtin_prefetch(reinterpret_cast<const char*>(impl) + 128);
    }
    for (size_t i = 0; i < n; i++) {
      c10::TensorImpl* impl = impls_[i];
      if (!impl->has_storage() || !impl->version_counter().enabled()) {
        return static_cast<int64_t>(i);
      }
      __builtin_prefetch(impl->unsafe_storage().unsafeGetStorageImpl());
      __builtin_prefetch(counter(impl));
    }
    for (size_t i = 0; i < n; i++) {
      c10::TensorImpl* impl = impls_[i];
      if (impl->version_counter().current_version() != versions_[i] ||
          impl->unsafe_storage().data() != data_[i] || impl->storage_offset() != storage_offsets_[i]) {
        return static_cast<int64_t>(i);
      }
      const Sample& s = samples_[i];
      if (s.size > 0) {
        if (static_cast<size_t>(s.offset + s.size) > impl->unsafe_storage().nbytes()) {
          return static_cast<int64_t>(i);
        }
        __builtin_prefetch(static_cast<const char*>(data_[i]) + s.offset);
      }
    }
    for (size_t i = 0; i < n; i++) {
      const Sample& s = samples_[i];
      if (s.size > 0) {
        uint64_t bits = 0;
        std::memcpy(&bits, static_cast<const char*>(data_[i]) + s.offset, static_cast<size_t>(s.size));
        if (bits != s.bits) {
          return static_cast<int64_t>(i);
        }
      }
    }
    return -1;
  }

  std::vector<py::object> objects_;  // held: the checks compare identities
  std::vector<int64_t> versions_;
  std::vector<const void*> data_;
  std::vector<int64_t> storage_offsets_;
  std::vector<Sample> samples_;
  std::vector<c10::TensorImpl*> impls_;  // scratch for one check
  PyObject* none_ = nullptr;              // the items of an empty selection
  // The value of ``keys_[i]`` in ``dicts_[i]`` (borrowed), found by a scan of the dict,
  // whose place and key object are kept for the next call; nullptr where the dict does
  // not hold the key (or, with a Python error set, where comparing keys raised).
  PyObject* locate(size_t i) {
    PyObject* dict = dicts_[i].ptr();
    PyObject *key, *value;
    Py_ssize_t pos = 0;
    while (PyDict_Next(dict, &pos, &key, &value)) {
      int equal = key == keys_[i].ptr() ? 1 : PyObject_RichCompareBool(key, keys_[i].ptr(), Py_EQ);
      if (equal < 0) {
        return nullptr;
      }
      if (equal) {
        places_[i] = pos - 1;
        keys_[i] = py::reinterpret_borrow<py::object>(key);
        return value;
      }
    }
    places_[i] = -1;
    return nullptr;
  }

  // The version counter's shared state (VariableVersion holds one intrusive_ptr to it),
  // to prefetch.
  static const void* counter(const c10::TensorImpl* impl) {
    static_assert(sizeof(c10::VariableVersion) == sizeof(void*), "VariableVersion is one pointer");
    return *reinterpret_cast<const void* const*>(&impl->version_counter());
  }

  std::vector<py::object> dicts_, keys_;  // set_registries (keys_: the dicts' own key objects)
  std::vector<Py_ssize_t> places_;        // each key's place in its dict's entry table, or -1
  std::vector<PyObject*> registered_;     // scratch for same_registered (borrowed)
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "lort's frozen-weight check (runtime/frozen.py)";
  m.attr("ABI") = 4;
  py::class_<WeightCheck>(m, "WeightCheck")
      .def(py::init<py::sequence, std::vector<int64_t>, std::vector<int64_t>, std::vector<uint64_t>>(),
           py::arg("tensors"), py::arg("offsets"), py::arg("sizes"), py::arg("bits"))
      .def("same", &WeightCheck::same, py::arg("picked"))
      .def("first_change", &WeightCheck::first_change_of, py::arg("picked"))
      .def("set_registries", &WeightCheck::set_registries, py::arg("dicts"), py::arg("keys"))
      .def("same_registered", &WeightCheck::same_registered);
}
