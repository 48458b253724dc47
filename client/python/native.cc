// ckptd._native: the C++ client (client/ckpt_client.h) for Python. Only bindings live here;
// everything the client does stays in C++.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <xxhash.h>

#include <chrono>
#include <exception>
#include <memory>
#include <optional>
#include <thread>

#include "client/checkpoint_list.h"
#include "client/ckpt_client.h"
#include "client/python/native_plan.h"
#include "storage/filesystem.h"
#include "storage/open_store.h"
#include "common/dtype.h"
#include "common/status.h"

namespace py = pybind11;

namespace {

// Raised for every failed call; `code` is the absl status code name ("UNAVAILABLE", ...).
PyObject* g_error = nullptr;
PyObject* g_unavailable = nullptr;

[[noreturn]] void Raise(const absl::Status& status) {
  PyObject* type = absl::IsUnavailable(status) ? g_unavailable : g_error;
  py::object error = py::reinterpret_borrow<py::object>(type)(ckpt::Message(status));
  error.attr("code") = absl::StatusCodeToString(status.code());
  PyErr_SetObject(type, error.ptr());
  throw py::error_already_set();
}

template <typename T>
T ValueOr(absl::StatusOr<T> result) {
  if (!result.ok()) Raise(result.status());
  return *std::move(result);
}

void Check(const absl::Status& status) {
  if (!status.ok()) Raise(status);
}

// A tensor's bytes in a shared-memory arena, exposed through the buffer protocol so that
// torch.frombuffer() wraps them without a copy. Holds the client: the arena stays mapped
// while any tensor uses it, even after the session is closed.
struct ArenaBuffer {
  std::shared_ptr<ckpt::Client> client;
  ckpt::Tensor* tensor;
};

// A whole flat parameter shard (AllocateFlatShard): the pieces are registered tensors inside it.
struct SharedBuffer {
  std::shared_ptr<ckpt::Client> client;
  void* data;
  size_t nbytes;
};

py::dict TicketDict(const ckpt::TicketStatus& status) {
  py::dict d;
  d["state"] = ckpt::ToString(status.state);
  d["error"] = status.error;
  return d;
}

std::chrono::milliseconds Millis(double seconds) {
  return std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000));
}

// ---- calls without the GIL ----
//
// Every call that may block (on ckptd, on storage) runs without the GIL, through
// WithoutGil. Taking the GIL back is where a Python thread dies at exit: once the
// interpreter finalizes, CPython (3.8 to 3.13) ends any other thread that asks for the GIL
// with pthread_exit, and the unwinding that follows aborts the whole process ("terminate
// called without an active exception") when it meets a C++ frame that may not throw, as
// pybind11's gil_scoped_release destructor is. The threads that come back then are daemon
// threads left running at exit: the manager's connection attempt after a load that gave up
// on a stalled ckptd, a thread waiting for a ticket. So a thread other than the main one
// that comes back while the interpreter finalizes never asks: it waits here until the
// process ends (what Python 3.14 does with such threads itself), holding no lock and
// nothing that anyone waits for. A thread that was already waiting for the GIL when
// finalization began is still ended by CPython, but its unwinding meets no such frame.

// Python's main thread (threading.main_thread(), set when the module loads): with the
// process's first thread, the one that finalizes the interpreter. Taking another thread
// for it only sends that thread the way CPython ends it (see below), never to an abort.
unsigned long g_main_thread = 0;

bool OnMainThread() {
  return PyThread_get_thread_ident() == g_main_thread || ::syscall(SYS_gettid) == ::getpid();
}

bool Finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing() != 0;
#else
  return _Py_IsFinalizing() != 0;
#endif
}

void TakeGilBack(PyThreadState* saved) {
  if (Finalizing() && !OnMainThread()) {
    while (true) std::this_thread::sleep_for(std::chrono::hours(24));
  }
  PyEval_RestoreThread(saved);
}

// `f()` without the GIL: its result, or what it threw, once the GIL is back.
template <typename F>
auto WithoutGil(F&& f) -> decltype(f()) {
  std::optional<decltype(f())> result;
  std::exception_ptr thrown;
  PyThreadState* saved = PyEval_SaveThread();
  try {
    result.emplace(f());
  } catch (...) {
    thrown = std::current_exception();
  }
  TakeGilBack(saved);
  if (thrown) std::rethrow_exception(thrown);
  return *std::move(result);
}

class PyClient {
 public:
  explicit PyClient(std::shared_ptr<ckpt::Client> client) : client_(std::move(client)) {}

  ArenaBuffer Allocate(const std::string& name, const std::string& dtype,
                       const std::vector<int64_t>& shape, const std::vector<int64_t>& global_shape,
                       const std::vector<int64_t>& global_offset, size_t spare_bytes) {
    return {client_, ValueOr(client_->AllocateTensor(name, dtype, shape, global_shape, global_offset,
                                                     spare_bytes))};
  }

  ArenaBuffer AllocateFlat(const std::string& name, const std::string& dtype,
                           const std::vector<int64_t>& global_shape,
                           const std::vector<std::pair<int64_t, int64_t>>& ranges) {
    std::vector<ckpt::ElementRange> flat;
    for (auto [b, e] : ranges) flat.push_back({b, e});
    return {client_, ValueOr(client_->AllocateFlatTensor(name, dtype, global_shape, flat))};
  }

  // pieces: (name, global_shape, begin, end, at) as in ckpt::FlatPiece.
  SharedBuffer AllocateFlatShard(
      const std::string& dtype, int64_t numel,
      const std::vector<std::tuple<std::string, std::vector<int64_t>, int64_t, int64_t, int64_t>>& pieces) {
    std::vector<ckpt::FlatPiece> flat;
    for (const auto& [name, global, b, e, at] : pieces) flat.push_back({name, global, {b, e}, at});
    ckpt::FlatShard shard = ValueOr(client_->AllocateFlatShard(dtype, numel, flat));
    size_t itemsize = ValueOr(ckpt::DTypeSize(dtype));
    return {client_, shard.data, shard.numel * itemsize};
  }

  void AddCuda(const std::string& name, const std::string& dtype, const std::vector<int64_t>& shape,
               uintptr_t device_ptr, const std::vector<int64_t>& global_shape,
               const std::vector<int64_t>& global_offset) {
    ValueOr(client_->AddCudaTensor(name, dtype, shape, reinterpret_cast<void*>(device_ptr),
                                   global_shape, global_offset));
  }

  // Exceptions need the GIL: every call that releases it raises after taking it back.
  void Register() { Check(WithoutGil([&] { return client_->Register(); })); }

  uint64_t Snapshot(uint64_t step, const ckpt::Metadata& metadata, const std::map<std::string, py::bytes>& state) {
    ckpt::TrainState train_state;
    for (const auto& [k, v] : state) train_state[k] = std::string(v);
    return ValueOr(WithoutGil([&] { return client_->Snapshot(step, metadata, train_state); }));
  }

  py::dict Poll(uint64_t ticket) { return TicketDict(client_->Poll(ticket)); }

  py::dict WaitStaged(uint64_t ticket, double timeout_s) {
    return TicketDict(ValueOr(WithoutGil([&] { return client_->WaitStaged(ticket, Millis(timeout_s)); })));
  }

  py::dict WaitCommitted(uint64_t ticket, double timeout_s) {
    return TicketDict(ValueOr(WithoutGil([&] { return client_->WaitCommitted(ticket, Millis(timeout_s)); })));
  }

  void SetCudaStream(uintptr_t stream) { client_->SetCudaStream(reinterpret_cast<void*>(stream)); }

  void StreamWaitStaged(uint64_t ticket, uintptr_t stream) {
    Check(client_->StreamWaitStaged(ticket, reinterpret_cast<void*>(stream)));
  }

  py::dict Restore(std::optional<uint64_t> step, std::vector<std::string> include,
                   std::vector<std::string> exclude, bool allow_missing, bool cast) {
    ckpt::RestoreInfo r = ValueOr(WithoutGil([&] {
      return client_->Restore(ckpt::RestoreOptions{step, std::move(include), std::move(exclude), allow_missing, cast});
    }));
    py::dict d;
    d["found"] = r.found;
    d["step"] = r.step;
    d["source"] = ckpt::RestoreSourceName(r.source);
    d["bytes"] = r.bytes;
    d["metadata"] = r.metadata;
    py::dict state;
    for (const auto& [k, v] : r.train_state) state[py::str(k)] = py::bytes(v);
    d["train_state"] = state;
    d["tensors"] = r.tensors;
    d["skipped"] = r.skipped;
    d["not_in_checkpoint"] = r.not_in_checkpoint;
    d["not_registered"] = r.not_registered;
    d["warnings"] = r.warnings;
    d["saved_world_size"] = r.saved_world_size;
    d["other_jobs"] = r.other_jobs;
    return d;
  }

  bool ShouldSave(uint64_t step, double interval_s, uint64_t run) {
    return ValueOr(WithoutGil([&] {
      return client_->ShouldSave(step, std::chrono::milliseconds(static_cast<int64_t>(interval_s * 1000.0)), run);
    }));
  }

  void Update() { Check(WithoutGil([&] { return client_->Update(); })); }

  void RemoveTensor(const std::string& name) { Check(client_->RemoveTensor(name)); }
  // Updated a few rows at a time: small chunks with increments; before register().
  void MarkSparse(const std::vector<std::string>& names) {
    for (const std::string& name : names) Check(client_->MarkSparse(name));
  }
  // Frozen (true) or ordinary again, at the next update() once registered.
  void SetFrozen(const std::vector<std::string>& names, bool frozen) {
    for (const std::string& name : names) Check(frozen ? client_->Freeze(name) : client_->Thaw(name));
  }

  std::vector<uint64_t> CommittedSteps() const { return client_->committed_steps(); }
  uint64_t CommittedCount() const { return client_->committed_count(); }

  void Unregister() { Check(WithoutGil([&] { return client_->Unregister(); })); }

  std::string session_id() const { return client_->session_id(); }
  int AbandonPending() { return client_->AbandonPending(); }

 private:
  std::shared_ptr<ckpt::Client> client_;
};

py::tuple ListCheckpoints(const std::string& socket, const std::string& job) {
  ckpt::CheckpointList list = ValueOr(WithoutGil([&] { return ckpt::ListCheckpoints(socket, job); }));
  py::list out;
  for (const ckpt::CheckpointListing& c : list.checkpoints) {
    py::dict d;
    d["job"] = c.job;
    d["step"] = c.step;
    d["world_size"] = c.world_size;
    d["tensors"] = c.tensors;
    d["bytes"] = c.bytes;
    d["unix_time"] = c.unix_time;
    d["tiers"] = c.tiers;
    d["flags"] = c.flags;
    d["error"] = c.error;
    d["files"] = c.files;
    out.append(d);
  }
  return py::make_tuple(out, list.errors);
}

PyClient Connect(const std::string& socket, const std::string& job, uint32_t rank,
                 uint32_t world_size, size_t arena_bytes, double rpc_timeout_s,
                 const std::string& cuda_transport, uint32_t keep_last, bool huge_pages, bool copy_on_write,
                 std::optional<uint32_t> upload_every_steps, std::optional<double> upload_interval_seconds) {
  ckpt::ClientOptions options;
  options.socket = socket;
  options.job = job;
  options.rank = rank;
  options.world_size = world_size;
  options.arena_bytes = arena_bytes;
  options.huge_pages = huge_pages;
  options.copy_on_write = copy_on_write;
  options.rpc_timeout = Millis(rpc_timeout_s);
  options.keep_last = keep_last;
  if (upload_every_steps || upload_interval_seconds) {
    options.upload = ckpt::ClientOptions::UploadPolicy{upload_every_steps.value_or(1),
                                                       upload_interval_seconds.value_or(0)};
  }
  if (cuda_transport == "host-copy") {
    options.cuda_transport = ckpt::CudaTransport::kHostCopy;
  } else if (cuda_transport != "ipc") {
    Raise(absl::InvalidArgumentError("cuda_transport must be \"ipc\" or \"host-copy\", not \"" +
                                     cuda_transport + "\""));
  }
  return PyClient(std::shared_ptr<ckpt::Client>(ValueOr(WithoutGil([&] { return ckpt::Client::Connect(options); }))));
}

// Read access to where checkpoints are stored, a local directory or an s3:// URL (the
// endpoint, region and keys from the AWS environment): the same storage library ckptd and
// ckptctl read through, for ckptd.dcp's reader.
class PyObjectReader {
 public:
  explicit PyObjectReader(std::unique_ptr<ckpt::storage::ObjectReader> reader)
      : reader_(std::move(reader)) {}
  uint64_t size() const { return reader_->size(); }
  // Up to `n` bytes at `offset` (fewer at the end of the object).
  py::bytes Read(uint64_t offset, uint64_t n) const {
    const uint64_t size = reader_->size();
    n = offset >= size ? 0 : std::min(n, size - offset);
    std::string data(n, '\0');
    if (n > 0) Check(WithoutGil([&] { return reader_->ReadAt(data.data(), n, offset); }));
    return py::bytes(data);
  }

 private:
  std::unique_ptr<ckpt::storage::ObjectReader> reader_;
};

class PyStore {
 public:
  explicit PyStore(ckpt::storage::StorePtr store) : store_(std::move(store)) {}
  // Each call runs without the GIL and raises ckptd.Error (with it) when it fails.
  PyObjectReader Open(const std::string& key) {
    return PyObjectReader(ValueOr(WithoutGil([&] { return store_->Open(key); })));
  }
  py::bytes Get(const std::string& key, size_t max_bytes) {
    return py::bytes(ValueOr(WithoutGil([&] { return store_->Get(key, max_bytes); })));
  }
  bool Exists(const std::string& key) {
    return ValueOr(WithoutGil([&] { return store_->Exists(key); }));
  }
  std::string Describe(const std::string& key) const { return store_->Describe(key); }

 private:
  ckpt::storage::StorePtr store_;
};

PyStore OpenStore(const std::string& where, const std::string& s3_endpoint) {
  return PyStore(ValueOr(ckpt::storage::OpenStore(where, ckpt::MakePosixFilesystem(),
                                                  {.s3_endpoint = s3_endpoint})));
}

}  // namespace

PYBIND11_MODULE(_native, m) {
  m.doc() = "ckptd's C++ trainer client (see ckptd.Client and ckptd.torch)";
  g_main_thread = py::module_::import("threading").attr("main_thread")().attr("ident").cast<unsigned long>();
  g_error = PyErr_NewException("ckptd.Error", PyExc_RuntimeError, nullptr);
  g_unavailable = PyErr_NewException("ckptd.Unavailable", g_error, nullptr);
  m.attr("Error") = py::handle(g_error);
  m.attr("Unavailable") = py::handle(g_unavailable);

  py::class_<ArenaBuffer>(m, "ArenaBuffer", py::buffer_protocol())
      .def_buffer([](ArenaBuffer& b) {
        // The tensor's bytes and its spare bytes after them (see ckpt::Tensor).
        return py::buffer_info(b.tensor->data, 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(b.tensor->nbytes + b.tensor->spare_bytes)},
                               {1});
      })
      .def_property_readonly("name", [](const ArenaBuffer& b) { return b.tensor->name; })
      .def_property_readonly("nbytes", [](const ArenaBuffer& b) { return b.tensor->nbytes; })
      .def_property_readonly("address", [](const ArenaBuffer& b) {
        return reinterpret_cast<uintptr_t>(b.tensor->data);
      });

  py::class_<SharedBuffer>(m, "SharedBuffer", py::buffer_protocol())
      .def_buffer([](SharedBuffer& b) {
        return py::buffer_info(b.data, 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(b.nbytes)}, {1});
      })
      .def_property_readonly("nbytes", [](const SharedBuffer& b) { return b.nbytes; });

  py::class_<PyClient>(m, "Client")
      .def("allocate_flat", &PyClient::AllocateFlat, py::arg("name"), py::arg("dtype"),
           py::arg("global_shape"), py::arg("ranges"),
           "A 1-D tensor holding element ranges [(begin, end), ...] of the flattened tensor of "
           "global_shape, one after another (an FSDP-style flat shard), as a writable buffer")
      .def("allocate_flat_shard", &PyClient::AllocateFlatShard, py::arg("dtype"), py::arg("numel"),
           py::arg("pieces"),
           "One buffer of numel elements (a rank's shard of an FSDP flat parameter) holding "
           "pieces (name, global_shape, begin, end, at): elements [begin, end) of tensor name, "
           "stored from element at of the shard; elements no piece covers are not checkpointed")
      .def("allocate", &PyClient::Allocate, py::arg("name"), py::arg("dtype"), py::arg("shape"),
           py::arg("global_shape") = std::vector<int64_t>{},
           py::arg("global_offset") = std::vector<int64_t>{}, py::arg("spare_bytes") = size_t{0},
           "A zeroed tensor in shared memory (before register()), as a writable buffer; "
           "spare_bytes more follow it, in the buffer, that ckptd does not checkpoint")
      .def("add_cuda", &PyClient::AddCuda, py::arg("name"), py::arg("dtype"), py::arg("shape"),
           py::arg("device_ptr"), py::arg("global_shape") = std::vector<int64_t>{},
           py::arg("global_offset") = std::vector<int64_t>{})
      .def("register", &PyClient::Register)
      .def("snapshot", &PyClient::Snapshot, py::arg("step"),
           py::arg("metadata") = ckpt::Metadata{},
           py::arg("train_state") = std::map<std::string, py::bytes>{})
      .def("poll", &PyClient::Poll, py::arg("ticket"))
      .def("wait_staged", &PyClient::WaitStaged, py::arg("ticket"), py::arg("timeout") = 600.0)
      .def("wait_committed", &PyClient::WaitCommitted, py::arg("ticket"), py::arg("timeout") = 1800.0)
      .def("set_cuda_stream", &PyClient::SetCudaStream, py::arg("stream"))
      .def("stream_wait_staged", &PyClient::StreamWaitStaged, py::arg("ticket"), py::arg("stream"))
      .def("restore", &PyClient::Restore, py::arg("step") = std::nullopt,
           py::arg("include") = std::vector<std::string>{},
           py::arg("exclude") = std::vector<std::string>{}, py::arg("allow_missing") = false,
           py::arg("cast") = false)
      .def("should_save", &PyClient::ShouldSave, py::arg("step"), py::arg("interval_seconds"),
           py::arg("run") = 0)
      .def("update", &PyClient::Update)
      .def("remove", &PyClient::RemoveTensor, py::arg("name"))
      .def("set_frozen", &PyClient::SetFrozen, py::arg("names"), py::arg("frozen"))
      .def("mark_sparse", &PyClient::MarkSparse, py::arg("names"))
      .def("unregister", &PyClient::Unregister)
      .def_property_readonly("committed_steps", &PyClient::CommittedSteps)
      .def_property_readonly("committed_count", &PyClient::CommittedCount)
      .def("abandon_pending", &PyClient::AbandonPending,
           "Gives up on every snapshot not yet staged: ckptd never commits them")
      .def_property_readonly("session_id", &PyClient::session_id);

  py::class_<PyObjectReader>(m, "ObjectReader")
      .def_property_readonly("size", &PyObjectReader::size)
      .def("read", &PyObjectReader::Read, py::arg("offset"), py::arg("size"),
           "Up to size bytes at offset (fewer at the object's end)");
  py::class_<PyStore>(m, "Store")
      .def("open", &PyStore::Open, py::arg("key"))
      .def("get", &PyStore::Get, py::arg("key"), py::arg("max_bytes"))
      .def("exists", &PyStore::Exists, py::arg("key"))
      .def("describe", &PyStore::Describe, py::arg("key"));
  m.def("open_store", &OpenStore, py::arg("where"), py::arg("s3_endpoint") = "",
        "Where checkpoints are stored: a directory, or s3://bucket/prefix with the endpoint, "
        "region and keys taken from the AWS environment (as ckptd and ckptctl take them)");

  // The checksum ckptd records for every tensor piece (docs/format.md), for readers of its
  // files that run without the daemon (ckptd.dcp).
  m.def("xxh3_64", [](py::buffer data) {
    py::buffer_info info = data.request();
    return WithoutGil([&] { return XXH3_64bits(info.ptr, static_cast<size_t>(info.size * info.itemsize)); });
  }, py::arg("data"), "XXH3-64 of a buffer's bytes");
  m.def("list_checkpoints", &ListCheckpoints, py::arg("socket"), py::arg("job") = "",
        "The committed checkpoints of `job` (every job when empty) that the ckptd at `socket` "
        "holds: (list of dicts, errors naming tiers that could not be listed).");
  m.def("connect", &Connect, py::arg("socket"), py::arg("job"), py::arg("rank") = 0,
        py::arg("world_size") = 1, py::arg("arena_bytes") = size_t{64} << 20,
        py::arg("rpc_timeout") = 30.0, py::arg("cuda_transport") = "ipc", py::arg("keep_last") = 0,
        py::arg("huge_pages") = true, py::arg("copy_on_write") = false,
        py::arg("upload_every_steps") = std::nullopt, py::arg("upload_interval_seconds") = std::nullopt,
        "Connects to ckptd; raises ckptd.Unavailable when it is not there");
  ckpt::python::DefinePlanRead(m);
}
