// _ucp: the compiled half of the Python package `ucp` (python/ucp/__init__.py
// is the other): a thin layer over the engine's public headers and the CLI's
// commands, in-process.
//
//   Checkpoint(path, format, options, threads, memory)
//       a checkpoint of any readable format (formats::Source, its plan read
//       as universal content: universal::PlanInput) or a universal file
//       (atoms::AtomStoreReader, universal::StoreInput);
//   Checkpoint.read(name, state, offset, size, dtype, address, nbytes)
//       region (offset, size) of an atom, converted to `dtype`, written to
//       `nbytes` bytes at `address` (a numpy array's or a CPU torch
//       tensor's memory, which the caller keeps alive) by the engine's
//       executor: only the region's source bytes are read;
//   run_command(name, args)
//       a `ucp` command (convert, reshape, ...) with its command-line
//       arguments; returns (exit code, its --json document or None).
//
// The GIL is released while the engine works (opening, planning, reading,
// commands). Every ucp::Error becomes the Python exception of its class
// (ucp.FormatError, ...: exit_code and kind attributes, the CLI's one-line
// message); a command-line parse error becomes ucp.UsageError as `ucp`
// reports it.

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <atomic>
#include <boost/program_options/errors.hpp>
#include <cstring>
#include <filesystem>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "cli/command.h"
#include "cli/dist.h"
#include "cli/options.h"
#include "engine/atoms/atom_store.h"
#include "engine/atoms/signature.h"
#include "engine/core/box.h"
#include "engine/core/dtype.h"
#include "engine/core/error.h"
#include "engine/core/progress.h"
#include "engine/formats/driver.h"
#include "engine/json/json.h"
#include "engine/reshape/executor.h"
#include "engine/reshape/plan.h"
#include "engine/universal/input.h"
#include "engine/universal/source_plan.h"

namespace py = pybind11;

namespace ucp::python {
namespace {

namespace fs = std::filesystem;

// The commands the module runs by name. `ucp diff` (issue 41) joins here
// as {"diff", cli::RunDiff} once it is merged.
struct NamedCommand {
  const char* name;
  int (*run)(const std::vector<std::string>&);
};
constexpr NamedCommand kCommands[] = {
    {"to-universal", cli::RunToUniversal},
    {"reshape", cli::RunReshape},
    {"convert", cli::RunConvert},
    {"export", cli::RunExport},
    {"resume", cli::RunResume},
    {"verify", cli::RunVerify},
    {"manifest", cli::RunManifest},
    {"diff", cli::RunDiff},
};

// One command at a time: the JSON sink and the progress mode are
// process-wide.
std::mutex g_command_mutex;

// The Python exception classes, by exit code (ucp::Error::ExitCode).
struct ExceptionClasses {
  py::object base, format, layout, usage, io, internal;
  const py::object& For(int exit_code) const {
    switch (exit_code) {
      case 2:
        return usage;
      case 3:
        return format;
      case 4:
        return layout;
      case 5:
        return io;
      case 70:
        return internal;
      default:
        return base;
    }
  }
};
ExceptionClasses& Exceptions() {
  static ExceptionClasses* classes = new ExceptionClasses();  // never freed
  return *classes;
}

// Sets the Python error for a ucp failure: the class of `exit_code`, the
// message as the CLI's line has it (one line), and the attributes kind,
// exit_code and message.
void SetPythonError(const char* kind, int exit_code, std::string_view what) {
  const py::object& cls = Exceptions().For(exit_code);
  const std::string line = cli::OneLine(what);
  py::object e = cls(line);
  e.attr("kind") = kind;
  e.attr("exit_code") = exit_code;
  e.attr("message") = line;
  PyErr_SetObject(cls.ptr(), e.ptr());
}

// Writes target bytes into caller memory of `size` bytes.
class MemorySink : public reshape::ByteSink {
 public:
  MemorySink(std::byte* data, uint64_t size) : data_(data), size_(size) {}
  void Write(uint64_t offset, std::span<const std::byte> data) override {
    UCP_CHECK(offset <= size_ && data.size() <= size_ - offset, "write of ",
              data.size(), " bytes at ", offset, " past ", size_);
    std::memcpy(data_ + offset, data.data(), data.size());
  }

 private:
  std::byte* data_;
  uint64_t size_;
};

std::string ShapeText(std::span<const int64_t> shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    if (i) s += ", ";
    s += std::to_string(shape[i]);
  }
  return s + "]";
}

// The topology a universal file records of its source.
json::Value UniversalTopology(const universal::SourceInfo& s) {
  json::Value t = json::Value::Object();
  const std::pair<const char*, const std::optional<int64_t>*> sizes[] = {
      {"tp", &s.tp},
      {"pp", &s.pp},
      {"vpp", &s.vpp},
      {"dp", &s.dp},
      {"cp", &s.cp},
      {"ep", &s.ep},
      {"zero_stage", &s.zero_stage}};
  for (const auto& [name, value] : sizes) {
    if (value->has_value()) t[name] = **value;
  }
  if (s.distributed_optimizer)
    t["distributed_optimizer"] = *s.distributed_optimizer;
  return t;
}

// One param as the Python side sees it.
struct ParamView {
  std::string name;
  std::vector<int64_t> shape;
  std::string dtype;
  std::vector<std::string> states;
  // Each state's dataset: its shape and stored dtype.
  std::vector<std::vector<int64_t>> state_shapes;
  std::vector<std::string> state_dtypes;
  std::string kind;
  bool frozen = false;
};

class Checkpoint {
 public:
  // Opens `path`: a universal file, or a checkpoint of format `format`
  // (detected if empty) with the driver's source options `options` (name ->
  // value; a flag "true"), layout `layout` ("" detected) and the true
  // vocabulary size `vocab_size` (0: the checkpoint's). Throws what the
  // driver's Open and Plan throw, UsageError for an unknown option or a bad
  // memory / threads / vocab_size.
  Checkpoint(const std::string& path, const std::string& format,
             const std::vector<std::pair<std::string, std::string>>& options,
             const std::string& layout, int64_t vocab_size, int threads,
             const std::string& memory)
      : path_(path) {
    if (vocab_size < 0) throw UsageError("vocab_size must be >= 1");
    if (threads < 0) throw UsageError("threads must be >= 0 (0: all cores)");
    executor_.threads = threads;
    executor_.memory_budget = reshape::ParseByteSize(memory);
    if (executor_.memory_budget < (16u << 20))
      throw UsageError("memory ", memory, " is too small (at least 16M)");
    std::error_code ec;
    if (!fs::exists(path_, ec))
      throw IoError("cannot open ", path, ": no such file or directory");
    if (!fs::is_directory(path_, ec) && atoms::IsHdf5File(path_) &&
        (format.empty() || format == "universal")) {
      if (!options.empty() || !layout.empty() || vocab_size > 0)
        throw UsageError(path, " is a universal file: it takes no options");
      store_.emplace(atoms::AtomStoreReader::Open(path_));
      input_ = universal::StoreInput(*store_);
      format_ = "universal";
      iteration_ = input_->model().iteration;
      topology_ = UniversalTopology(input_->model().source);
      return;
    }
    const formats::Driver& driver = formats::DetectDriver(path_, format);
    formats::SourceOptions o;
    o.layout = layout;
    if (vocab_size > 0) o.true_vocab_size = vocab_size;
    for (const auto& [name, value] : options) o.values.Set(name, value);
    formats::CheckOptions(driver.SourceOptionSpecs(), o.values, driver.Name(),
                          "reading");
    source_ = driver.Open(path_, o);
    plan_ = std::make_unique<universal::SourcePlan>(source_->Plan());
    input_ = universal::PlanInput(*plan_, source_->info().path, executor_);
    format_ = std::string(driver.Name());
    iteration_ = source_->info().iteration;
    topology_ = source_->info().TopologyJson();
  }

  const std::string& format() const { return format_; }
  int64_t iteration() const { return iteration_; }
  std::string topology_json() const { return topology_.Dump(); }
  std::string path() const { return path_.string(); }
  uint64_t bytes_read() const { return bytes_read_.load(); }

  std::vector<ParamView> params() const {
    std::vector<ParamView> out;
    const auto datasets = input_->datasets();
    for (const atoms::StoredParam& p : input_->params()) {
      ParamView v;
      v.name = p.info.fqn;
      v.shape = p.info.shape;
      v.dtype = std::string(DTypeName(p.info.dtype));
      v.kind = std::string(atoms::ParamKindName(p.info.kind));
      v.frozen = p.info.frozen;
      for (atoms::DatasetId id : p.atoms) {
        UCP_CHECK(id < datasets.size() && datasets[id].id == id, "dataset ", id,
                  " of param ", p.info.fqn);
        v.states.push_back(datasets[id].state_kind);
        v.state_shapes.push_back(datasets[id].shape);
        v.state_dtypes.push_back(std::string(DTypeName(datasets[id].dtype)));
      }
      out.push_back(std::move(v));
    }
    return out;
  }

  // Region (offset, size) of param `name`'s state `state`, as `dtype`, into
  // `nbytes` bytes at `address`; returns the source bytes read. Throws
  // UsageError naming the param for an unknown param or state, a region
  // outside the tensor, a dtype the engine cannot convert to, a buffer of
  // another size; what the executor throws.
  uint64_t Read(const std::string& name, const std::string& state,
                const std::vector<int64_t>& offset,
                const std::vector<int64_t>& size, const std::string& dtype,
                uintptr_t address, uint64_t nbytes) {
    const atoms::DatasetInfo* d = input_->FindAtom(name, state);
    if (d == nullptr) {
      const atoms::StoredParam* p = input_->FindParam(name);
      if (p == nullptr) throw UsageError(path_.string(), ": no param ", name);
      std::string have;
      for (atoms::DatasetId id : p->atoms)
        have += (have.empty() ? "" : ", ") + input_->datasets()[id].state_kind;
      throw UsageError(path_.string(), " > param ", name, ": no state ", state,
                       " (it has: ", have, ")");
    }
    const Box box{offset, size};
    if (box.rank() != d->shape.size() || offset.size() != size.size() ||
        !BoxInside(box, d->shape)) {
      throw UsageError(path_.string(), " > param ", name, " > ", state,
                       ": region ", box.ToString(), " is not inside shape ",
                       ShapeText(d->shape));
    }
    const std::optional<DType> target = DTypeFromName(dtype);
    if (!target) throw UsageError("unknown dtype ", dtype);
    const uint64_t need =
        static_cast<uint64_t>(box.NumElements()) * ElementSize(*target);
    if (need != nbytes) {
      throw UsageError(path_.string(), " > param ", name, " > ", state,
                       ": region ", box.ToString(), " of ", dtype, " is ", need,
                       " bytes, the buffer ", nbytes);
    }
    if (need == 0) return 0;
    reshape::TargetTensor t;
    t.name = StrCat("param ", name, " > ", state);
    t.dtype = *target;
    t.shape = size;
    t.ops.push_back(
        reshape::CopyOp{input_->Tensor(*d), box, Box::Whole(size), 0, {}});
    MemorySink sink(reinterpret_cast<std::byte*>(address), nbytes);
    // One read at a time (Python threads may share a checkpoint); each read
    // runs on the executor's threads.
    std::lock_guard<std::mutex> lock(read_mutex_);
    reshape::Job job;
    job.tensor = std::move(t);
    job.sink = &sink;
    const reshape::ExecutorStats stats =
        input_->Run(std::span<reshape::Job>(&job, 1), executor_);
    bytes_read_ += stats.bytes_read;
    return stats.bytes_read;
  }

 private:
  fs::path path_;
  reshape::ExecutorOptions executor_;
  // The input refers to the store or to the plan (and the source): it is
  // declared last, destroyed first.
  std::optional<atoms::AtomStoreReader> store_;
  std::unique_ptr<formats::Source> source_;
  std::unique_ptr<universal::SourcePlan> plan_;
  std::unique_ptr<universal::UniversalInput> input_;
  std::string format_;
  int64_t iteration_ = 0;
  json::Value topology_;
  std::atomic<uint64_t> bytes_read_{0};
  std::mutex read_mutex_;
};

// Runs command `name` with `args`; (exit code, its JSON document or None).
// `progress`, unless None, is called as progress(label, done, total) from
// the engine's threads (with the GIL; an exception it raises is reported as
// unraisable and ignored).
py::tuple RunCommand(const std::string& name,
                     const std::vector<std::string>& args,
                     const py::object& progress) {
  const NamedCommand* command = nullptr;
  for (const NamedCommand& c : kCommands) {
    if (name == c.name) command = &c;
  }
  if (command == nullptr) throw UsageError("unknown command '", name, "'");
  std::optional<std::string> doc;
  int rc = 0;
  // A reference to the callback held by every copy of the observer (a
  // Progress copies it when made, and one made by another thread's open()
  // may outlive this command), dropped under the GIL.
  std::shared_ptr<py::object> callback;
  if (!progress.is_none()) {
    callback = std::shared_ptr<py::object>(new py::object(progress),
                                           [](py::object* o) {
                                             py::gil_scoped_acquire gil;
                                             delete o;
                                           });
  }
  {
    py::gil_scoped_release release;
    std::lock_guard<std::mutex> lock(g_command_mutex);
    cli::SetJsonSink([&doc](const json::Value& v) { doc = v.Dump(); });
    if (callback) {
      Progress::SetObserver(
          [callback](const std::string& label, uint64_t done, uint64_t total) {
            py::gil_scoped_acquire gil;
            try {
              (*callback)(label, done, total);
            } catch (py::error_already_set& e) {
              e.discard_as_unraisable("ucp progress callback");
            } catch (...) {
            }
          });
    }
    struct Restore {
      ~Restore() {
        cli::SetJsonSink(nullptr);
        Progress::SetObserver(nullptr);
      }
    } restore;
    try {
      rc = command->run(args);
    } catch (const boost::program_options::error& e) {
      throw UsageError(e.what(), " (see: ucp ", name, " --help)");
    }
  }
  py::object json_doc = py::none();
  if (doc) json_doc = py::str(*doc);
  return py::make_tuple(rc, json_doc);
}

}  // namespace
}  // namespace ucp::python

PYBIND11_MODULE(_ucp, m) {
  using namespace ucp::python;
  m.doc() = "ucp's engine (use the package `ucp`)";
  // In-process commands run in this process alone, also under a launcher
  // (a job of several processes is `torchrun ... ucp convert`).
  ucp::cli::SetJobsEnabled(false);

  ExceptionClasses& ex = Exceptions();
  ex.base = py::reinterpret_steal<py::object>(
      PyErr_NewException("ucp.Error", PyExc_Exception, nullptr));
  auto sub = [&](const char* name) {
    return py::reinterpret_steal<py::object>(
        PyErr_NewException(name, ex.base.ptr(), nullptr));
  };
  ex.format = sub("ucp.FormatError");
  ex.layout = sub("ucp.LayoutError");
  ex.usage = sub("ucp.UsageError");
  ex.io = sub("ucp.IoError");
  ex.internal = sub("ucp.InternalError");
  m.attr("Error") = ex.base;
  m.attr("FormatError") = ex.format;
  m.attr("LayoutError") = ex.layout;
  m.attr("UsageError") = ex.usage;
  m.attr("IoError") = ex.io;
  m.attr("InternalError") = ex.internal;
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const ucp::Error& e) {
      SetPythonError(e.kind(), e.ExitCode(), e.what());
    } catch (const std::bad_alloc&) {
      PyErr_SetString(PyExc_MemoryError,
                      "out of memory (lower memory= or threads=)");
    } catch (const py::error_already_set&) {
      throw;
    } catch (const py::builtin_exception&) {
      throw;
    } catch (const std::exception& e) {
      // As the CLI: any other C++ exception is an internal error (70).
      SetPythonError("internal error", 70, e.what());
    }
  });

  py::class_<ParamView>(m, "ParamInfo")
      .def_readonly("name", &ParamView::name)
      .def_property_readonly("shape",
                             [](const ParamView& p) {
                               py::tuple t(p.shape.size());
                               for (size_t i = 0; i < p.shape.size(); ++i)
                                 t[i] = p.shape[i];
                               return t;
                             })
      .def_readonly("dtype", &ParamView::dtype)
      .def_readonly("states", &ParamView::states)
      .def_readonly("state_shapes", &ParamView::state_shapes)
      .def_readonly("state_dtypes", &ParamView::state_dtypes)
      .def_readonly("kind", &ParamView::kind)
      .def_readonly("frozen", &ParamView::frozen);

  py::class_<Checkpoint>(m, "Checkpoint")
      .def(py::init<const std::string&, const std::string&,
                    const std::vector<std::pair<std::string, std::string>>&,
                    const std::string&, int64_t, int, const std::string&>(),
           py::arg("path"), py::arg("format"), py::arg("options"),
           py::arg("layout"), py::arg("vocab_size"), py::arg("threads"),
           py::arg("memory"), py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("format", &Checkpoint::format)
      .def_property_readonly("iteration", &Checkpoint::iteration)
      .def_property_readonly("path", &Checkpoint::path)
      .def_property_readonly("topology_json", &Checkpoint::topology_json)
      .def_property_readonly("bytes_read", &Checkpoint::bytes_read)
      .def("params", &Checkpoint::params)
      .def("read", &Checkpoint::Read, py::arg("name"), py::arg("state"),
           py::arg("offset"), py::arg("size"), py::arg("dtype"),
           py::arg("address"), py::arg("nbytes"),
           py::call_guard<py::gil_scoped_release>());

  m.def("run_command", &RunCommand, py::arg("name"), py::arg("args"),
        py::arg("progress") = py::none());
  m.def("commands", [] {
    std::vector<std::string> names;
    for (const NamedCommand& c : kCommands) names.emplace_back(c.name);
    return names;
  });
}
