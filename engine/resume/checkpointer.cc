#include "engine/resume/checkpointer.h"

#include <fcntl.h>
#include <torch/nn/module.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <charconv>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <set>
#include <span>
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>

#include "engine/core/error.h"
#include "engine/core/file.h"
#include "engine/pickle/value.h"
#include "engine/torchfile/torch_file.h"
#include "engine/torchfile/torch_writer.h"
#include "engine/torchfile/zip.h"

namespace ucp::resume {

namespace fs = std::filesystem;

// --- ProcessGroup ------------------------------------------------------------

namespace {

// The first line of a foreign exception's message (LibTorch appends a C++
// backtrace to c10::Error::what()).
std::string Brief(const std::exception& e) {
  std::string s = e.what();
  if (const auto* c = dynamic_cast<const c10::Error*>(&e)) {
    s = c->what_without_backtrace();
  }
  const size_t nl = s.find('\n');
  if (nl != std::string::npos) s.resize(nl);
  if (s.size() > 300) s.resize(300);
  return s;
}

}  // namespace

struct ProcessGroup::Impl {
  int rank = 0;
  int size = 1;
  std::chrono::milliseconds timeout{0};
  c10::intrusive_ptr<c10d::Store> store;
  c10::intrusive_ptr<c10d::ProcessGroupGloo> pg;

  // Waits for `work`; a failure or timeout becomes one IoError.
  void Wait(const c10::intrusive_ptr<c10d::Work>& work,
            std::string_view what) const {
    try {
      work->wait(timeout);
    } catch (const std::exception& e) {
      throw IoError("rank ", rank, " of ", size, ": ", what,
                    ": a rank died or did not arrive within ",
                    timeout.count() / 1000.0, " s (", Brief(e), ")");
    }
  }
  void Broadcast(at::Tensor& t, std::string_view what) const {
    if (size == 1) return;
    std::vector<at::Tensor> v{t};
    Wait(pg->broadcast(v), what);
  }
  void AllReduce(at::Tensor& t, c10d::ReduceOp op,
                 std::string_view what) const {
    if (size == 1) return;
    std::vector<at::Tensor> v{t};
    c10d::AllreduceOptions o;
    o.reduceOp = op;
    Wait(pg->allreduce(v, o), what);
  }
  // Every rank's `local` (same numel everywhere), concatenated.
  at::Tensor AllGather(const at::Tensor& local, std::string_view what) const {
    if (size == 1) return local;
    std::vector<at::Tensor> in{local};
    std::vector<std::vector<at::Tensor>> out(1);
    for (int r = 0; r < size; ++r) out[0].push_back(at::empty_like(local));
    Wait(pg->allgather(out, in), what);
    return at::cat(out[0]);
  }
  void Barrier(std::string_view what) const {
    if (size == 1) return;
    // A Gloo barrier ignores the timeout of wait(); an allreduce honours it.
    at::Tensor t = at::zeros({1}, at::kLong);
    AllReduce(t, c10d::ReduceOp::SUM, what);
  }
};

ProcessGroup::ProcessGroup(std::shared_ptr<Impl> impl)
    : impl_(std::move(impl)) {}

ProcessGroup ProcessGroup::Single() {
  return ProcessGroup(std::make_shared<Impl>());
}

int ProcessGroup::rank() const noexcept { return impl_->rank; }
int ProcessGroup::size() const noexcept { return impl_->size; }

void ProcessGroup::AllReduceMean(at::Tensor& t, std::string_view what) const {
  if (impl_->size == 1) return;
  impl_->AllReduce(t, c10d::ReduceOp::SUM, what);
  t.div_(impl_->size);
}

void ProcessGroup::Barrier(std::string_view what) const {
  impl_->Barrier(what);
}

ProcessGroup ProcessGroup::Connect(int rank, int world_size,
                                   const std::string& master_addr,
                                   int master_port,
                                   std::chrono::milliseconds timeout) {
  if (world_size < 1 || rank < 0 || rank >= world_size) {
    throw UsageError("rank ", rank, " of world size ", world_size,
                     " is not a rank of it");
  }
  if (master_port < 1 || master_port > 65535) {
    throw UsageError("master port ", master_port, " is not a TCP port");
  }
  auto impl = std::make_shared<Impl>();
  impl->rank = rank;
  impl->size = world_size;
  impl->timeout = timeout;
  if (world_size == 1) return ProcessGroup(std::move(impl));
  try {
    c10d::TCPStoreOptions o;
    o.port = static_cast<uint16_t>(master_port);
    o.isServer = rank == 0;
    o.numWorkers = static_cast<size_t>(world_size);
    o.waitWorkers = true;
    o.timeout = timeout;
    impl->store = c10::make_intrusive<c10d::TCPStore>(master_addr, o);
    auto options = c10d::ProcessGroupGloo::Options::create(timeout);
    const bool loopback =
        master_addr == "127.0.0.1" || master_addr == "localhost";
    options->devices.push_back(
        loopback ? c10d::ProcessGroupGloo::createDeviceForHostname("127.0.0.1")
                 : c10d::ProcessGroupGloo::createDefaultDevice());
    impl->pg = c10::make_intrusive<c10d::ProcessGroupGloo>(impl->store, rank,
                                                           world_size, options);
  } catch (const std::exception& e) {
    throw IoError("rank ", rank, " of ", world_size, ": rendezvous at ",
                  master_addr, ":", master_port, " failed within ",
                  timeout.count() / 1000.0, " s (", Brief(e), ")");
  }
  return ProcessGroup(std::move(impl));
}

namespace {

int EnvInt(const char* name, int fallback) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return fallback;
  int out = 0;
  const auto [end, ec] = std::from_chars(v, v + std::strlen(v), out);
  if (ec != std::errc() || *end != '\0') {
    throw UsageError("environment variable ", name, "='", v,
                     "' is not an integer");
  }
  return out;
}

}  // namespace

ProcessGroup ProcessGroup::FromEnv(std::chrono::milliseconds timeout) {
  const int world = EnvInt("WORLD_SIZE", 1);
  const int rank = EnvInt("RANK", 0);
  const char* addr = std::getenv("MASTER_ADDR");
  return Connect(rank, world, addr ? addr : "127.0.0.1",
                 EnvInt("MASTER_PORT", 29500), timeout);
}

// --- Checkpointer
// --------------------------------------------------------------

namespace {

constexpr int kMaxCandidates = 256;

std::string StepName(int64_t step) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "step_%09lld", static_cast<long long>(step));
  return buf;
}

std::string ShardName(int rank, int world) {
  char buf[64];
  std::snprintf(buf, sizeof buf, "shard_%05d-of-%05d.pt", rank, world);
  return buf;
}

// step_<digits> -> the step; nullopt for anything else.
std::optional<int64_t> ParseStepName(const std::string& name) {
  if (name.rfind("step_", 0) != 0 || name.size() == 5) return std::nullopt;
  int64_t v = 0;
  const char* b = name.data() + 5;
  const char* e = name.data() + name.size();
  const auto [end, ec] = std::from_chars(b, e, v);
  if (ec != std::errc() || end != e || v < 0) return std::nullopt;
  return v;
}

void SyncPath(const fs::path& p) {
  if (!DurableWrites()) return;
  const int fd = ::open(p.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0)
    throw IoError("cannot open ", p.string(), ": ", std::strerror(errno));
  const int rc = ::fsync(fd);
  const int err = errno;
  ::close(fd);
  if (rc != 0)
    throw IoError("fsync failed on ", p.string(), ": ", std::strerror(err));
}

// tmp name, write, fsync, rename.
void WriteDurably(const fs::path& path, std::string_view bytes) {
  const fs::path tmp = path.string() + ".tmp";
  {
    File f = File::Create(tmp);
    f.WriteExact(bytes.data(), bytes.size(), 0);
    f.Sync();
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);
  if (ec) {
    throw IoError("cannot rename ", tmp.string(), " to ", path.string(), ": ",
                  ec.message());
  }
}

void RemoveTree(const fs::path& p) {
  std::error_code ec;
  fs::remove_all(p, ec);
  if (ec) throw IoError("cannot remove ", p.string(), ": ", ec.message());
}

struct Param {
  std::string name;
  at::Tensor tensor;
  std::vector<int64_t> shape;
  int64_t offset = 0;  // in the flat vector
  int64_t numel = 0;
  int64_t index = -1;  // in the optimizer's (Python) numbering; -1: not in it
};

struct Layout {
  std::vector<Param> params;
  int64_t numel = 0;
};

Layout MakeLayout(const TrainingState& s) {
  if (s.model == nullptr || s.optimizer == nullptr) {
    throw UsageError("a checkpoint needs a model and an optimizer");
  }
  Layout l;
  std::map<const void*, size_t> by_impl;
  for (const auto& item : s.model->named_parameters(/*recurse=*/true)) {
    const at::Tensor& t = item.value();
    if (t.scalar_type() != at::kFloat || !t.is_contiguous() ||
        !t.device().is_cpu()) {
      throw UsageError("param ", item.key(),
                       ": only contiguous float32 CPU parameters are "
                       "checkpointed (it is ",
                       c10::toString(t.scalar_type()), ")");
    }
    Param p;
    p.name = item.key();
    p.tensor = t;
    p.shape = t.sizes().vec();
    p.offset = l.numel;
    p.numel = t.numel();
    l.numel += p.numel;
    by_impl[t.unsafeGetTensorImpl()] = l.params.size();
    l.params.push_back(std::move(p));
  }
  int64_t index = 0;
  for (const auto& group : s.optimizer->param_groups()) {
    for (const at::Tensor& t : group.params()) {
      auto it = by_impl.find(t.unsafeGetTensorImpl());
      if (it == by_impl.end()) {
        throw UsageError(
            "the optimizer holds a tensor that is not a "
            "parameter of the model");
      }
      l.params[it->second].index = index++;
    }
  }
  return l;
}

// --- torch.save of IValues ---------------------------------------------------
//
// The checkpointer's files are written by ucp's torch.save writer
// (engine/torchfile), not torch::pickle_save: LibTorch's pickler tags typed
// containers with torch.jit._pickle.restore_type_tag, a global the
// weights-only unpickler of torch.load (the default since torch 2.6)
// refuses. Here dicts, lists and tuples are plain, as Python's torch.save
// writes them, and each tensor is stored compactly.

// The dtypes a checkpoint holds, as LibTorch and ucp name them.
constexpr std::pair<at::ScalarType, DType> kDTypes[] = {
    {at::kFloat, DType::kFloat32}, {at::kDouble, DType::kFloat64},
    {at::kHalf, DType::kFloat16},  {at::kBFloat16, DType::kBFloat16},
    {at::kLong, DType::kInt64},    {at::kInt, DType::kInt32},
    {at::kShort, DType::kInt16},   {at::kChar, DType::kInt8},
    {at::kByte, DType::kUInt8},    {at::kBool, DType::kBool}};

DType ScalarDType(at::ScalarType t) {
  for (const auto& [at_type, dtype] : kDTypes)
    if (at_type == t) return dtype;
  throw UsageError("cannot checkpoint a tensor of dtype ", c10::toString(t));
}

pickle::Value* ToPickle(
    torchfile::TorchWriter& w, const c10::IValue& v,
    std::vector<std::pair<const pickle::Value*, at::Tensor>>& tensors) {
  pickle::Arena& a = w.arena();
  if (v.isNone()) return a.None();
  if (v.isBool()) return a.Bool(v.toBool());
  if (v.isInt()) return a.Int(v.toInt());
  if (v.isDouble()) return a.Float(v.toDouble());
  if (v.isString()) return a.Str(v.toStringRef());
  if (v.isTensor()) {
    const at::Tensor t = v.toTensor().detach().to(at::kCPU).contiguous();
    torchfile::TensorSpec spec;
    spec.dtype = ScalarDType(t.scalar_type());
    spec.shape = Shape(t.sizes().begin(), t.sizes().end());
    pickle::Value* node = w.NewTensor(spec);
    tensors.emplace_back(node, t);
    return node;
  }
  if (v.isTuple()) {
    std::vector<pickle::Value*> items;
    for (const c10::IValue& x : v.toTupleRef().elements())
      items.push_back(ToPickle(w, x, tensors));
    return a.Tuple(std::move(items));
  }
  if (v.isList()) {
    std::vector<pickle::Value*> items;
    for (const c10::IValue& x : v.toListRef())
      items.push_back(ToPickle(w, x, tensors));
    return a.List(std::move(items));
  }
  if (v.isGenericDict()) {
    std::vector<std::pair<pickle::Value*, pickle::Value*>> entries;
    for (const auto& kv : v.toGenericDict())
      entries.emplace_back(ToPickle(w, kv.key(), tensors),
                           ToPickle(w, kv.value(), tensors));
    return a.Dict(std::move(entries));
  }
  throw UsageError("cannot checkpoint a value of type ", v.tagKind(),
                   " (dicts, lists, tuples, strings, numbers, None and "
                   "tensors are)");
}

// torch.save bytes of `v`, archive folder `archive` (torch.save names it
// after the file).
std::string SaveIValue(const c10::IValue& v, const std::string& archive) {
  torchfile::TorchWriterOptions options;
  options.archive_name = archive;
  options.in_memory = true;
  torchfile::TorchWriter w(archive + ".pt", options);
  std::vector<std::pair<const pickle::Value*, at::Tensor>> tensors;
  const pickle::Value* root = ToPickle(w, v, tensors);
  w.Begin(root);
  for (const auto& [node, t] : tensors) {
    w.WriteTensorData(node, 0,
                      std::span<const std::byte>(
                          static_cast<const std::byte*>(t.data_ptr()),
                          static_cast<size_t>(t.numel()) * t.element_size()));
  }
  w.Commit();
  return w.Contents();
}

at::ScalarType TorchScalarType(DType t) {
  for (const auto& [at_type, dtype] : kDTypes)
    if (dtype == t) return at_type;
  throw FormatError("a tensor of dtype ", DTypeName(t),
                    " (the checkpointer stores none)");
}

// The IValue of a node of `f`'s graph, tensors read whole. meta.pt is parsed
// by ucp's unpickler rather than torch::pickle_load: LibTorch's (1.13) lacks
// opcodes Python's pickler writes (APPEND), and a meta.pt re-saved by Python
// must still load.
c10::IValue FromPickle(const torchfile::TorchFile& f, const pickle::Value* v) {
  using pickle::Kind;
  if (const torchfile::TensorInfo* t = f.FindTensor(v)) {
    at::Tensor out = at::empty(
        t->shape, at::TensorOptions().dtype(TorchScalarType(t->dtype)));
    f.ReadTensor(*t, std::span<std::byte>(
                         static_cast<std::byte*>(out.data_ptr()), t->nbytes));
    return out;
  }
  switch (v->kind) {
    case Kind::kNone:
      return c10::IValue();
    case Kind::kBool:
      return v->b;
    case Kind::kFloat:
      return v->f;
    case Kind::kStr:
      return v->s;
    case Kind::kInt:
      if (v->AsInt()) return *v->AsInt();
      break;
    case Kind::kTuple: {
      std::vector<c10::IValue> items;
      for (const pickle::Value* x : v->items) items.push_back(FromPickle(f, x));
      return c10::ivalue::Tuple::create(std::move(items));
    }
    case Kind::kList: {
      c10::impl::GenericList out(c10::AnyType::get());
      for (const pickle::Value* x : v->items) out.push_back(FromPickle(f, x));
      return out;
    }
    default:
      break;
  }
  if (v->IsDictLike()) {
    c10::impl::GenericDict out(c10::AnyType::get(), c10::AnyType::get());
    for (const auto& [k, x] : v->entries)
      out.insert_or_assign(FromPickle(f, k), FromPickle(f, x));
    return out;
  }
  throw FormatError("holds a ", pickle::KindName(v->kind), " ", v->ClassName(),
                    " (dicts, lists, tuples, numbers, strings and tensors are "
                    "expected)");
}

// A list of ints, typed (torch::pickle_save's files) or not (ucp's).
std::vector<int64_t> IntsOf(const c10::IValue& v) {
  if (v.isIntList()) return v.toIntVector();
  std::vector<int64_t> out;
  for (const c10::IValue& x : v.toListRef()) out.push_back(x.toInt());
  return out;
}

// The Adam/AdamW hyper-parameters of a group, as Python's state_dict has them.
c10::impl::GenericDict GroupDict(const torch::optim::OptimizerParamGroup& g,
                                 const std::vector<int64_t>& indices) {
  c10::impl::GenericDict d(c10::StringType::get(), c10::AnyType::get());
  double lr = 0, eps = 0, wd = 0, b1 = 0, b2 = 0;
  bool amsgrad = false;
  if (auto* o = dynamic_cast<const torch::optim::AdamOptions*>(&g.options())) {
    lr = o->lr(), eps = o->eps(), wd = o->weight_decay(),
    b1 = std::get<0>(o->betas()), b2 = std::get<1>(o->betas()),
    amsgrad = o->amsgrad();
  } else if (auto* w = dynamic_cast<const torch::optim::AdamWOptions*>(
                 &g.options())) {
    lr = w->lr(), eps = w->eps(), wd = w->weight_decay(),
    b1 = std::get<0>(w->betas()), b2 = std::get<1>(w->betas()),
    amsgrad = w->amsgrad();
  } else {
    throw UsageError("only torch::optim::Adam and AdamW are checkpointed");
  }
  d.insert("lr", lr);
  d.insert("betas", c10::ivalue::Tuple::create({b1, b2}));
  d.insert("eps", eps);
  d.insert("weight_decay", wd);
  d.insert("amsgrad", amsgrad);
  d.insert("maximize", false);
  d.insert("foreach", c10::IValue());
  d.insert("capturable", false);
  d.insert("differentiable", false);
  d.insert("fused", false);
  d.insert("params", c10::List<int64_t>(indices));
  return d;
}

void SetGroup(torch::optim::OptimizerParamGroup& g, const c10::IValue& v) {
  const auto d = v.toGenericDict();
  const double lr = d.at("lr").toDouble();
  const double eps = d.at("eps").toDouble();
  const double wd = d.at("weight_decay").toDouble();
  const auto betas = d.at("betas").toTupleRef().elements();
  const std::tuple<double, double> b{betas[0].toDouble(), betas[1].toDouble()};
  const bool amsgrad = d.at("amsgrad").toBool();
  if (auto* o = dynamic_cast<torch::optim::AdamOptions*>(&g.options())) {
    o->lr(lr).eps(eps).weight_decay(wd).betas(b).amsgrad(amsgrad);
  } else if (auto* w =
                 dynamic_cast<torch::optim::AdamWOptions*>(&g.options())) {
    w->lr(lr).eps(eps).weight_decay(wd).betas(b).amsgrad(amsgrad);
  }
}

std::string StateKey(const at::Tensor& t) {
  return c10::guts::to_string(t.unsafeGetTensorImpl());
}

// The Adam state of `p`: (step, exp_avg, exp_avg_sq); step -1 when none.
struct AdamState {
  int64_t step = -1;
  at::Tensor exp_avg, exp_avg_sq;
};

AdamState GetState(torch::optim::Optimizer& opt, const at::Tensor& p) {
  auto& states = opt.state();
  auto it = states.find(StateKey(p));
  if (it == states.end()) return {};
  if (auto* a = dynamic_cast<torch::optim::AdamParamState*>(it->second.get()))
    return {a->step(), a->exp_avg(), a->exp_avg_sq()};
  if (auto* w = dynamic_cast<torch::optim::AdamWParamState*>(it->second.get()))
    return {w->step(), w->exp_avg(), w->exp_avg_sq()};
  throw UsageError("only torch::optim::Adam and AdamW are checkpointed");
}

void SetState(torch::optim::Optimizer& opt, const at::Tensor& p, int64_t step,
              at::Tensor exp_avg, at::Tensor exp_avg_sq) {
  const bool adamw = !opt.param_groups().empty() &&
                     dynamic_cast<const torch::optim::AdamWOptions*>(
                         &opt.param_groups()[0].options()) != nullptr;
  if (adamw) {
    auto s = std::make_unique<torch::optim::AdamWParamState>();
    s->step(step).exp_avg(exp_avg).exp_avg_sq(exp_avg_sq);
    opt.state()[StateKey(p)] = std::move(s);
  } else {
    auto s = std::make_unique<torch::optim::AdamParamState>();
    s->step(step).exp_avg(exp_avg).exp_avg_sq(exp_avg_sq);
    opt.state()[StateKey(p)] = std::move(s);
  }
}

c10::IValue ScalerDict(const ScalerState* s) {
  if (s == nullptr) return c10::IValue();
  c10::impl::GenericDict d(c10::StringType::get(), c10::AnyType::get());
  d.insert("scale", s->scale);
  d.insert("growth_factor", s->growth_factor);
  d.insert("backoff_factor", s->backoff_factor);
  d.insert("growth_interval", s->growth_interval);
  d.insert("_growth_tracker", s->growth_tracker);
  return d;
}

// The slice [begin, end) of rank r of w over n elements.
std::pair<int64_t, int64_t> Slice(int64_t n, int r, int w) {
  const int64_t chunk = (n + w - 1) / w;
  const int64_t b = std::min<int64_t>(n, chunk * r);
  return {b, std::min<int64_t>(n, b + chunk)};
}

std::string ShapeText(const std::vector<int64_t>& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i) {
    s += (i ? ", " : "") + std::to_string(shape[i]);
  }
  return s + "]";
}

// What every rank knows of a candidate after checking it.
struct Meta {
  int64_t step = 0;
  int world = 0;
  int64_t numel = 0;
  c10::IValue root;  // the meta.pt dict
};

// Reads and checks meta.pt (every record's CRC-32 first).
Meta ReadMeta(const fs::path& dir, const Layout& layout) {
  const fs::path path = dir / "meta.pt";
  const std::string bytes = ReadSmallFile(path, size_t{1} << 30);
  // The records' CRC-32s over the bytes just read (the file is read once).
  const torchfile::ZipReader zip = torchfile::ZipReader::Open(path);
  for (const auto& e : zip.entries()) {
    const uint64_t at = zip.DataOffset(e);
    std::vector<torchfile::CrcPiece> read;
    if (at <= bytes.size() && e.compressed_size <= bytes.size() - at) {
      read.push_back({0, e.compressed_size,
                      torchfile::Crc32(std::as_bytes(std::span<const char>(
                          bytes.data() + at, e.compressed_size)))});
    }
    if (!zip.CheckCrc(e, read)) {
      throw FormatError(path.string(), " > record ", e.name,
                        ": CRC-32 mismatch (damaged after it was written)");
    }
  }
  Meta m;
  try {
    const torchfile::TorchFile f = torchfile::TorchFile::Open(path);
    m.root = FromPickle(f, f.root());
    const auto d = m.root.toGenericDict();
    if (d.at("format").toStringRef() != "ucp.checkpointer" ||
        d.at("version").toInt() != 1) {
      throw FormatError("not a ucp.checkpointer version 1 meta.pt");
    }
    m.step = d.at("step").toInt();
    m.world = static_cast<int>(d.at("world_size").toInt());
    m.numel = d.at("numel").toInt();
    const auto params = d.at("params").toList();
    if (m.world < 1 ||
        static_cast<size_t>(params.size()) != layout.params.size() ||
        m.numel != layout.numel) {
      throw FormatError("holds ", params.size(), " params of ", m.numel,
                        " elements; the model has ", layout.params.size(),
                        " of ", layout.numel);
    }
    for (size_t i = 0; i < layout.params.size(); ++i) {
      const auto t = params.get(i).toTupleRef().elements();
      const Param& p = layout.params[i];
      if (t[0].toStringRef() != p.name || IntsOf(t[1]) != p.shape ||
          t[2].toInt() != p.offset) {
        throw FormatError("param ", i, " is ", t[0].toStringRef(), " ",
                          ShapeText(IntsOf(t[1])), " at ", t[2].toInt(),
                          ", the model's is ", p.name, " ", ShapeText(p.shape),
                          " at ", p.offset);
      }
    }
  } catch (Error& e) {
    e.AddContext(path.string());
    throw;
  } catch (const std::exception& e) {
    throw FormatError(path.string(), ": ", Brief(e));
  }
  return m;
}

// Every record's CRC-32 of one shard, and that it parses.
void CheckShard(const fs::path& path) {
  const torchfile::TorchFile f = torchfile::TorchFile::Open(path);
  const torchfile::ZipReader* zip = f.zip();
  if (zip == nullptr)
    throw FormatError(path.string(), ": not a zip torch.save file");
  for (const auto& e : zip->entries()) {
    if (!zip->CheckCrc(e)) {
      throw FormatError(path.string(), " > record ", e.name,
                        ": CRC-32 mismatch (damaged after it was written)");
    }
  }
}

}  // namespace

struct Checkpointer::Impl {
  CheckpointerOptions o;
  int64_t resume_calls = 0;

  const ProcessGroup::Impl& g() const { return *o.group.impl(); }
  int rank() const { return g().rank; }
  int world() const { return g().size; }

  void Phase(std::string_view name, int64_t step) const {
    if (o.on_phase) o.on_phase(name, step);
  }

  // Rank 0: removes what crashed saves and rotations left.
  void RemoveLeftovers() const {
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(o.dir, ec)) {
      const std::string n = e.path().filename().string();
      if (n.rfind(".step_", 0) == 0) RemoveTree(e.path());
    }
  }

  std::vector<int64_t> ListSteps() const {
    std::vector<int64_t> steps;
    std::error_code ec;
    for (const auto& e : fs::directory_iterator(o.dir, ec)) {
      if (!e.is_directory(ec)) continue;
      if (auto s = ParseStepName(e.path().filename().string()))
        steps.push_back(*s);
    }
    std::sort(steps.rbegin(), steps.rend());
    return steps;
  }

  void Save(int64_t step, const TrainingState& s) {
    const Layout layout = MakeLayout(s);
    const fs::path partial = o.dir / ("." + StepName(step) + ".partial");
    if (rank() == 0) {
      RemoveLeftovers();
      std::error_code ec;
      fs::create_directories(partial, ec);
      if (ec)
        throw IoError("cannot create ", partial.string(), ": ", ec.message());
    }
    g().Barrier("save: start");

    // This rank's slice of the flat weights and Adam moments.
    const auto [b, e] = Slice(layout.numel, rank(), world());
    const at::Tensor w = at::empty({e - b}, at::kFloat);
    const at::Tensor m1 = at::zeros({e - b}, at::kFloat);
    const at::Tensor m2 = at::zeros({e - b}, at::kFloat);
    c10::Dict<std::string, at::Tensor> model;
    c10::impl::GenericDict state(c10::IntType::get(), c10::AnyType::get());
    c10::List<int64_t> steps;
    for (const Param& p : layout.params) {
      const AdamState st = GetState(*s.optimizer, p.tensor);
      steps.push_back(st.step);
      const int64_t lo = std::max(b, p.offset),
                    hi = std::min(e, p.offset + p.numel);
      if (lo >= hi) continue;
      auto piece = [&](const at::Tensor& flat, const at::Tensor& src) {
        at::Tensor v = flat.narrow(0, lo - b, hi - lo);
        v.copy_(src.detach().reshape({-1}).narrow(0, lo - p.offset, hi - lo));
        return hi - lo == p.numel ? v.view(p.shape) : v;
      };
      model.insert(p.name, piece(w, p.tensor));
      if (st.step >= 0 && p.index >= 0) {
        c10::impl::GenericDict ps(c10::StringType::get(), c10::AnyType::get());
        ps.insert("step",
                  at::scalar_tensor(static_cast<double>(st.step), at::kFloat));
        ps.insert("exp_avg", piece(m1, st.exp_avg));
        ps.insert("exp_avg_sq", piece(m2, st.exp_avg_sq));
        state.insert(p.index, ps);
      }
    }
    c10::impl::GenericDict buffers(c10::StringType::get(), c10::AnyType::get());
    if (rank() == 0) {  // buffers: shard 0's model dict and meta.pt
      for (const auto& item : s.model->named_buffers(/*recurse=*/true)) {
        const at::Tensor copy = item.value().detach().clone();
        buffers.insert(item.key(), copy);
        model.insert(item.key(), copy);
      }
    }
    c10::List<c10::IValue> groups(c10::AnyType::get());
    {
      int64_t index = 0;
      for (const auto& group : s.optimizer->param_groups()) {
        std::vector<int64_t> idx;
        for (size_t i = 0; i < group.params().size(); ++i)
          idx.push_back(index++);
        groups.push_back(GroupDict(group, idx));
      }
    }
    c10::IValue extra = s.extra
                            ? c10::IValue(*s.extra)
                            : c10::IValue(c10::impl::GenericDict(
                                  c10::StringType::get(), c10::AnyType::get()));

    c10::impl::GenericDict optimizer(c10::StringType::get(),
                                     c10::AnyType::get());
    optimizer.insert("state", state);
    optimizer.insert("param_groups", groups);
    c10::impl::GenericDict shard_info(c10::StringType::get(),
                                      c10::IntType::get());
    shard_info.insert("rank", rank());
    shard_info.insert("world_size", world());
    shard_info.insert("numel", layout.numel);
    shard_info.insert("begin", b);
    shard_info.insert("end", e);
    c10::impl::GenericDict shard(c10::StringType::get(), c10::AnyType::get());
    shard.insert("model", model);
    shard.insert("optimizer", optimizer);
    shard.insert("step", step);
    shard.insert("scaler", ScalerDict(s.scaler));
    shard.insert("extra", extra);
    shard.insert("shard", shard_info);
    const std::string shard_name = ShardName(rank(), world());
    WriteDurably(
        partial / shard_name,
        SaveIValue(shard, shard_name.substr(0, shard_name.size() - 3)));
    Phase("shard-written", step);
    g().Barrier("save: shards written");

    if (rank() == 0) {
      c10::List<c10::IValue> params(c10::AnyType::get());
      for (const Param& p : layout.params) {
        params.push_back(c10::ivalue::Tuple::create(
            {p.name, c10::List<int64_t>(p.shape), p.offset}));
      }
      c10::impl::GenericDict meta(c10::StringType::get(), c10::AnyType::get());
      meta.insert("format", "ucp.checkpointer");
      meta.insert("version", 1);
      meta.insert("step", step);
      meta.insert("world_size", world());
      meta.insert("numel", layout.numel);
      meta.insert("params", params);
      meta.insert("steps", steps);
      meta.insert("param_groups", groups);
      meta.insert("buffers", buffers);
      meta.insert("scaler", ScalerDict(s.scaler));
      meta.insert("extra", extra);
      WriteDurably(partial / "meta.pt", SaveIValue(meta, "meta"));
      SyncPath(partial);
      Phase("before-commit", step);
      const fs::path final_dir = o.dir / StepName(step);
      std::error_code ec;
      if (fs::exists(final_dir, ec)) {  // saved again after a resume
        const fs::path old = o.dir / ("." + StepName(step) + ".replaced");
        fs::rename(final_dir, old, ec);
        if (ec)
          throw IoError("cannot move ", final_dir.string(),
                        " aside: ", ec.message());
      }
      fs::rename(partial, final_dir, ec);
      if (ec) {
        throw IoError("cannot rename ", partial.string(), " to ",
                      final_dir.string(), ": ", ec.message());
      }
      SyncPath(o.dir);
      // Rotation: the oldest complete ones beyond keep_last, renamed away
      // first so that a crash never leaves a half-deleted step_* folder.
      const std::vector<int64_t> all = ListSteps();
      for (size_t i = static_cast<size_t>(o.keep_last); i < all.size(); ++i) {
        const fs::path victim = o.dir / StepName(all[i]);
        const fs::path doomed = o.dir / ("." + StepName(all[i]) + ".deleting");
        fs::rename(victim, doomed, ec);
        if (!ec) RemoveTree(doomed);
      }
      RemoveLeftovers();
      SyncPath(o.dir);
    }
    g().Barrier("save: committed");
  }

  // Checks candidate `step` as this rank's share: meta.pt, every shard
  // present, the shards r, r + size, ... fully. "" when fine.
  std::string Check(int64_t step, const Layout& layout, Meta* meta) const {
    const fs::path dir = o.dir / StepName(step);
    try {
      *meta = ReadMeta(dir, layout);
      if (meta->step != step) {
        throw FormatError(dir.string(), ": meta.pt says step ", meta->step);
      }
      std::error_code ec;
      for (int s = 0; s < meta->world; ++s) {
        const fs::path shard = dir / ShardName(s, meta->world);
        if (!fs::is_regular_file(shard, ec)) {
          throw FormatError(shard.string(), " is missing");
        }
      }
      for (int s = rank(); s < meta->world; s += world()) {
        CheckShard(dir / ShardName(s, meta->world));
      }
    } catch (const Error& e) {
      return e.what();
    } catch (const std::exception& e) {
      return "unreadable: " + Brief(e);
    }
    return "";
  }

  // The flat data a shard holds: weights, exp_avg, exp_avg_sq.
  static constexpr int kKinds = 3;

  // Which of them the tensor at `p` in a shard's graph is a piece of
  // (model/<param>, optimizer/state/<index>/exp_avg[_sq]) and of which
  // param; kind -1 for others (buffers, steps, ...).
  static std::pair<int, const Param*> PieceOf(const torchfile::TensorPath& p,
                                              const Layout& layout) {
    auto str = [&](size_t i) -> const std::string* {
      return i < p.size() ? std::get_if<std::string>(&p[i]) : nullptr;
    };
    const std::string* head = str(0);
    if (head == nullptr) return {-1, nullptr};
    if (*head == "model" && p.size() == 2 && str(1)) {
      for (const Param& x : layout.params)
        if (x.name == *str(1)) return {0, &x};
      return {-1, nullptr};
    }
    if (*head == "optimizer" && p.size() == 4 && str(3)) {
      const int64_t* index = std::get_if<int64_t>(&p[2]);
      const int k = *str(3) == "exp_avg" ? 1 : *str(3) == "exp_avg_sq" ? 2 : -1;
      if (index == nullptr || k < 0) return {-1, nullptr};
      for (const Param& x : layout.params)
        if (x.index == *index) return {k, &x};
    }
    return {-1, nullptr};
  }

  // This rank's slices [b, e) of the flat weights and Adam moments: every
  // old shard that overlaps them is opened once and only the byte ranges of
  // the slice are read (a kind a shard lacks stays zero). A shard's tensor
  // for param p holds p's elements inside the shard's slice; it may view a
  // storage shared with others (files of torch::pickle_save) or own one.
  std::array<at::Tensor, kKinds> ReadSlices(const fs::path& dir, const Meta& m,
                                            int64_t b, int64_t e,
                                            const Layout& layout,
                                            uint64_t* bytes) const {
    std::array<at::Tensor, kKinds> out;
    for (at::Tensor& t : out)
      t = at::zeros({std::max<int64_t>(0, e - b)}, at::kFloat);
    for (int s = 0; s < m.world; ++s) {
      const auto [sb, se] = Slice(m.numel, s, m.world);
      if (std::max(b, sb) >= std::min(e, se)) continue;
      const fs::path path = dir / ShardName(s, m.world);
      const torchfile::TorchFile f = torchfile::TorchFile::Open(path);
      for (const auto& t : f.tensors()) {
        const auto [k, param] = t.path
                                    ? PieceOf(*t.path, layout)
                                    : std::pair<int, const Param*>{-1, nullptr};
        if (k < 0) continue;
        const int64_t vlo = std::max(sb, param->offset);
        const int64_t vhi = std::min(se, param->offset + param->numel);
        if (t.dtype != DType::kFloat32 || t.numel != vhi - vlo) {
          throw FormatError(path.string(), ": ", param->name, "'s ",
                            k == 0   ? "weights"
                            : k == 1 ? "exp_avg"
                                     : "exp_avg_sq",
                            " hold ", t.numel, " elements (",
                            DTypeName(t.dtype), "), the slice has ", vhi - vlo,
                            " float32");
        }
        const int64_t lo = std::max(b, vlo), hi = std::min(e, vhi);
        if (lo >= hi) continue;
        const uint64_t n = static_cast<uint64_t>(hi - lo) * 4;
        float* to = out[static_cast<size_t>(k)].data_ptr<float>() + (lo - b);
        f.ReadTensorRange(
            t, lo - vlo, hi - lo,
            std::span<std::byte>(reinterpret_cast<std::byte*>(to), n));
        *bytes += n;
      }
    }
    return out;
  }

  std::optional<ResumeReport> Resume(const TrainingState& s) {
    const Layout layout = MakeLayout(s);
    const int64_t call = resume_calls++;
    // Rank 0 lists; everyone checks the same candidates.
    at::Tensor list = at::full({kMaxCandidates + 1}, -1, at::kLong);
    if (rank() == 0) {
      RemoveLeftovers();
      const std::vector<int64_t> steps = ListSteps();
      const size_t n = std::min<size_t>(steps.size(), kMaxCandidates);
      list[0] = static_cast<int64_t>(n);
      for (size_t i = 0; i < n; ++i)
        list[static_cast<int64_t>(i + 1)] = steps[i];
    }
    g().Broadcast(list, "resume: list checkpoints");
    const int64_t count = list[0].item<int64_t>();
    if (count == 0) return std::nullopt;

    ResumeReport report;
    Meta meta;
    bool found = false;
    for (int64_t i = 0; i < count && !found; ++i) {
      const int64_t step = list[i + 1].item<int64_t>();
      const std::string why = Check(step, layout, &meta);
      at::Tensor ok = at::full({1}, why.empty() ? 1 : 0, at::kLong);
      if (world() > 1) {
        g().store->set("ucp/resume/" + std::to_string(call) + "/" +
                           std::to_string(step) + "/" + std::to_string(rank()),
                       std::vector<uint8_t>(why.begin(), why.end()));
      }
      g().AllReduce(ok, c10d::ReduceOp::MIN, "resume: agree on a checkpoint");
      if (ok.item<int64_t>() == 1) {
        found = true;
        report.step = step;
        break;
      }
      std::string reason =
          why.empty() ? "" : "rank " + std::to_string(rank()) + ": " + why;
      for (int r = 0; r < world() && reason.empty(); ++r) {
        const auto v =
            g().store->get("ucp/resume/" + std::to_string(call) + "/" +
                           std::to_string(step) + "/" + std::to_string(r));
        if (!v.empty())
          reason = "rank " + std::to_string(r) + ": " +
                   std::string(v.begin(), v.end());
      }
      report.skipped.push_back(StepName(step) + ": " + reason);
    }
    if (!found) {
      throw FormatError("no complete and intact checkpoint in ", o.dir.string(),
                        " (", count, " found; newest: ",
                        report.skipped.empty() ? "" : report.skipped.front(),
                        ")");
    }

    const fs::path dir = o.dir / StepName(report.step);
    report.checkpoint = dir;
    report.saved_world_size = meta.world;
    report.resharded = meta.world != world();
    const auto [b, e] = Slice(layout.numel, rank(), world());
    const int64_t chunk = (layout.numel + world() - 1) / world();
    auto full = [&](at::Tensor local, std::string_view what) {
      at::Tensor padded = at::zeros({chunk}, at::kFloat);
      padded.narrow(0, 0, local.numel()).copy_(local);
      return g().AllGather(padded, what).narrow(0, 0, layout.numel);
    };
    const std::array<at::Tensor, kKinds> local =
        ReadSlices(dir, meta, b, e, layout, &report.bytes_read);
    const at::Tensor weights = full(local[0], "resume: weights");
    const at::Tensor m1 = full(local[1], "resume: exp_avg");
    const at::Tensor m2 = full(local[2], "resume: exp_avg_sq");

    const auto d = meta.root.toGenericDict();
    const auto steps = IntsOf(d.at("steps"));
    {
      at::NoGradGuard no_grad;
      for (size_t i = 0; i < layout.params.size(); ++i) {
        const Param& p = layout.params[i];
        p.tensor.copy_(weights.narrow(0, p.offset, p.numel).view(p.shape));
        s.optimizer->state().erase(StateKey(p.tensor));
        if (steps[i] >= 0 && p.index >= 0) {
          SetState(*s.optimizer, p.tensor, steps[i],
                   m1.narrow(0, p.offset, p.numel).view(p.shape).clone(),
                   m2.narrow(0, p.offset, p.numel).view(p.shape).clone());
        }
      }
      const auto buffers = d.at("buffers").toGenericDict();
      for (auto& item : s.model->named_buffers(/*recurse=*/true)) {
        if (!buffers.contains(item.key())) {
          throw FormatError(dir.string(), ": no buffer ", item.key());
        }
        item.value().copy_(buffers.at(item.key()).toTensor());
      }
    }
    const auto groups = d.at("param_groups").toList();
    auto& mine = s.optimizer->param_groups();
    for (size_t i = 0; i < mine.size() && i < groups.size(); ++i) {
      SetGroup(mine[i], groups.get(i));
    }
    if (s.scaler != nullptr && !d.at("scaler").isNone()) {
      const auto sc = d.at("scaler").toGenericDict();
      s.scaler->scale = sc.at("scale").toDouble();
      s.scaler->growth_factor = sc.at("growth_factor").toDouble();
      s.scaler->backoff_factor = sc.at("backoff_factor").toDouble();
      s.scaler->growth_interval = sc.at("growth_interval").toInt();
      s.scaler->growth_tracker = sc.at("_growth_tracker").toInt();
    }
    if (s.extra != nullptr) {
      s.extra->clear();
      for (const auto& kv : d.at("extra").toGenericDict()) {
        s.extra->insert(kv.key().toStringRef(), kv.value());
      }
    }
    g().Barrier("resume: done");
    return report;
  }
};

Checkpointer::Checkpointer(CheckpointerOptions options)
    : impl_(std::make_unique<Impl>()) {
  if (options.dir.empty()) throw UsageError("the checkpointer needs a folder");
  if (options.keep_last < 1) {
    throw UsageError("keep_last must be >= 1 (is ", options.keep_last, ")");
  }
  if (options.save_every < 0) throw UsageError("save_every must be >= 0");
  std::error_code ec;
  fs::create_directories(options.dir, ec);
  if (ec) {
    throw IoError("cannot create ", options.dir.string(), ": ", ec.message());
  }
  impl_->o = std::move(options);
}

Checkpointer::~Checkpointer() = default;
Checkpointer::Checkpointer(Checkpointer&&) noexcept = default;
Checkpointer& Checkpointer::operator=(Checkpointer&&) noexcept = default;

bool Checkpointer::Due(int64_t step) const noexcept {
  return impl_->o.save_every > 0 && step > 0 && step % impl_->o.save_every == 0;
}

void Checkpointer::Save(int64_t step, const TrainingState& state) {
  try {
    impl_->Save(step, state);
  } catch (Error& e) {
    e.AddContext("save of step ", step, " in ", impl_->o.dir.string());
    throw;
  } catch (const std::exception& e) {  // c10::Error from LibTorch
    throw IoError("save of step ", step, " in ", impl_->o.dir.string(), ": ",
                  Brief(e));
  }
}

std::optional<ResumeReport> Checkpointer::Resume(const TrainingState& state) {
  try {
    return impl_->Resume(state);
  } catch (Error& e) {
    e.AddContext("resume from ", impl_->o.dir.string());
    throw;
  } catch (const std::exception& e) {
    throw IoError("resume from ", impl_->o.dir.string(), ": ", Brief(e));
  }
}

}  // namespace ucp::resume
