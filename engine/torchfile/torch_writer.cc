#include "engine/torchfile/torch_writer.h"

#include <algorithm>
#include <optional>
#include <unordered_map>
#include <utility>

#include "engine/core/aligned_buffer.h"
#include "engine/core/error.h"
#include "engine/pickle/pickle.h"
#include "engine/torchfile/encoding.h"

namespace ucp::torchfile {

using pickle::Kind;
using pickle::ObjectOp;
using pickle::Value;

namespace {

struct TensorRecord {
  TensorSpec spec;
  Value* node = nullptr;  // what the caller places in the graph
  Value* key = nullptr;   // the storage key str node (set by Begin)
  std::vector<const Value*> trailing;  // pickled after the storage
  uint64_t nbytes = 0;
  std::optional<size_t> zip_index;  // set by Begin for planned tensors
};

constexpr size_t kFirstDataRecord = 2;  // after data.pkl and byteorder

}  // namespace

struct TorchWriter::Impl {
  std::filesystem::path path;
  TorchWriterOptions options;
  pickle::Arena arena;
  std::vector<TensorRecord> records;
  std::unordered_map<const Value*, size_t> by_node;
  std::vector<const Value*> planned;
  std::string pickle;
  std::vector<ZipRecordSpec> specs;
  std::optional<ZipWriter> zip;
  bool prepared = false;
  bool begun = false;

  // data.pkl, byteorder and version, once the zip writer exists.
  void WriteSmallRecords();

  // Nodes shared between tensors the way torch.save's pickler shares them.
  Value* storage_str = nullptr;
  Value* cpu_str = nullptr;

  Value* StorageStr() {
    if (storage_str == nullptr) storage_str = arena.Str("storage");
    return storage_str;
  }
  Value* Location(const std::string& device) {
    // torch's location tag for CPU is a constant string (one object, so
    // memoised); for CUDA it is built per call ('cuda:' + str(index)).
    if (device != "cpu") return arena.Str(device);
    if (cpu_str == nullptr) cpu_str = arena.Str("cpu");
    return cpu_str;
  }
  Value* EmptyOrderedDict() {
    return arena.Object(ObjectOp::kReduce,
                        arena.Global("collections", "OrderedDict"),
                        arena.Tuple({}));
  }
  Value* IntTuple(const std::vector<int64_t>& v) {
    std::vector<Value*> items;
    items.reserve(v.size());
    for (int64_t x : v) items.push_back(arena.Int(x));
    return arena.Tuple(std::move(items));
  }

  // The rebuild function and its argument tuple for a fresh compact storage.
  std::pair<Value*, Value*> RebuildCall(const TensorSpec& spec,
                                        bool requires_grad, Value** key) {
    const std::string_view typed = internal::TypedStorageName(spec.dtype);
    const int64_t numel = NumElements(spec.shape);
    *key = arena.Str("");
    Value* cls = typed.empty() ? arena.Global("torch.storage", "UntypedStorage")
                               : arena.Global("torch", std::string(typed));
    const int64_t pid_numel =
        typed.empty() ? numel * static_cast<int64_t>(ElementSize(spec.dtype))
                      : numel;
    Value* pid = arena.PersId(
        arena.Tuple({StorageStr(), cls, *key, Location(spec.device),
                     arena.Int(pid_numel)}));
    std::vector<Value*> args = {pid,
                                arena.Int(0),
                                IntTuple(spec.shape),
                                IntTuple(ContiguousStrides(spec.shape)),
                                arena.Bool(requires_grad),
                                EmptyOrderedDict()};
    Value* fn;
    if (typed.empty()) {
      fn = arena.Global("torch._utils", "_rebuild_tensor_v3");
      args.push_back(arena.Global("torch", std::string(DTypeName(spec.dtype))));
    } else {
      fn = arena.Global("torch._utils", "_rebuild_tensor_v2");
    }
    return {fn, arena.Tuple(std::move(args))};
  }

  void CheckSpec(const TensorSpec& spec) const {
    if (begun || prepared) {
      throw UsageError("NewTensor after Begin on ", path.string());
    }
    std::optional<int64_t> numel = CheckedNumElements(spec.shape);
    uint64_t nbytes = 0;
    if (!numel ||
        __builtin_mul_overflow(static_cast<uint64_t>(*numel),
                               ElementSize(spec.dtype), &nbytes) ||
        nbytes > (uint64_t{1} << 62)) {
      throw UsageError("invalid tensor shape for ", path.string());
    }
    if (spec.device.empty()) throw UsageError("empty tensor device");
  }

  Value* Register(TensorRecord rec) {
    rec.nbytes = static_cast<uint64_t>(NumElements(rec.spec.shape)) *
                 ElementSize(rec.spec.dtype);
    Value* node = rec.node;
    by_node.emplace(node, records.size());
    records.push_back(std::move(rec));
    return node;
  }

  const TensorRecord& Planned(const Value* tensor) const {
    if (!begun) throw UsageError("TorchWriter::Begin was not called");
    auto it = by_node.find(tensor);
    if (it == by_node.end() || !records[it->second].zip_index) {
      throw UsageError("tensor node is not planned for ", path.string());
    }
    return records[it->second];
  }
};

TorchWriter::TorchWriter(std::filesystem::path path, TorchWriterOptions options)
    : impl_(std::make_unique<Impl>()) {
  impl_->path = std::move(path);
  impl_->options = std::move(options);
}

TorchWriter::TorchWriter(TorchWriter&&) noexcept = default;
TorchWriter& TorchWriter::operator=(TorchWriter&&) noexcept = default;
TorchWriter::~TorchWriter() = default;

pickle::Arena& TorchWriter::arena() noexcept { return impl_->arena; }

Value* TorchWriter::NewTensor(const TensorSpec& spec) {
  Impl& im = *impl_;
  im.CheckSpec(spec);
  TensorRecord rec;
  rec.spec = spec;
  if (!spec.is_parameter) {
    auto [fn, args] = im.RebuildCall(spec, spec.requires_grad, &rec.key);
    rec.node = im.arena.Object(ObjectOp::kReduce, fn, args);
  } else {
    auto [fn, args] = im.RebuildCall(spec, false, &rec.key);
    Value* inner = im.arena.Object(ObjectOp::kReduce, fn, args);
    rec.node = im.arena.Object(
        ObjectOp::kReduce,
        im.arena.Global("torch._utils", "_rebuild_parameter"),
        im.arena.Tuple(
            {inner, im.arena.Bool(spec.requires_grad), im.EmptyOrderedDict()}));
  }
  return im.Register(std::move(rec));
}

Value* TorchWriter::NewTensorLike(const TensorInfo& source) {
  Impl& im = *impl_;
  TensorSpec spec;
  spec.dtype = source.dtype;
  spec.shape = source.shape;
  spec.requires_grad = source.requires_grad;
  spec.is_parameter = source.is_parameter;
  spec.device = source.device();
  if (source.wrapper == TensorWrapper::kNone ||
      source.wrapper == TensorWrapper::kParameter) {
    return NewTensor(spec);
  }
  im.CheckSpec(spec);
  const Value* src_args = source.node->args;
  UCP_CHECK(src_args != nullptr && src_args->items.size() == 4);
  TensorRecord rec;
  rec.spec = spec;
  if (source.wrapper == TensorWrapper::kParameterWithState) {
    auto [fn, args] = im.RebuildCall(spec, false, &rec.key);
    Value* inner = im.arena.Object(ObjectOp::kReduce, fn, args);
    Value* state = im.arena.Copy(src_args->items[3]);
    rec.node = im.arena.Object(
        ObjectOp::kReduce,
        im.arena.Global("torch._utils", "_rebuild_parameter_with_state"),
        im.arena.Tuple({inner, im.arena.Bool(spec.requires_grad),
                        im.EmptyOrderedDict(), state}));
    rec.trailing = {state};
  } else {  // kSubclass: _rebuild_from_type_v2(func, new_type, args, state)
    auto [fn, args] = im.RebuildCall(spec, spec.requires_grad, &rec.key);
    Value* new_type = im.arena.Copy(src_args->items[1]);
    Value* state = im.arena.Copy(src_args->items[3]);
    rec.node = im.arena.Object(
        ObjectOp::kReduce,
        im.arena.Global("torch._tensor", "_rebuild_from_type_v2"),
        im.arena.Tuple({fn, new_type, args, state}));
    rec.trailing = {new_type, state};
  }
  return im.Register(std::move(rec));
}

const TensorSpec* TorchWriter::FindSpec(const Value* tensor) const noexcept {
  auto it = impl_->by_node.find(tensor);
  return it == impl_->by_node.end() ? nullptr
                                    : &impl_->records[it->second].spec;
}

void TorchWriter::SetPath(std::filesystem::path path) {
  if (impl_->begun || impl_->prepared) {
    throw UsageError("TorchWriter::SetPath after Begin on ",
                     impl_->path.string());
  }
  impl_->path = std::move(path);
}

uint64_t TorchWriter::Prepare(const Value* root) {
  Impl& im = *impl_;
  if (im.begun || im.prepared) {
    throw UsageError("TorchWriter::Begin called twice");
  }
  UCP_CHECK(root != nullptr);
  std::vector<size_t> order;
  internal::ForEachInPickleOrder(root, [&](const Value* v,
                                           std::vector<const Value*>& then) {
    auto it = im.by_node.find(v);
    if (it != im.by_node.end()) {
      order.push_back(it->second);
      then = im.records[it->second].trailing;
      return false;
    }
    if (v->kind == Kind::kPersId) {
      throw UsageError(
          "the graph for ", im.path.string(),
          " holds a persistent id that no NewTensor made: ", pickle::Repr(v));
    }
    return true;
  });
  for (size_t k = 0; k < order.size(); ++k) {
    TensorRecord& rec = im.records[order[k]];
    rec.key->s = std::to_string(k);
    rec.zip_index = kFirstDataRecord + k;
    im.planned.push_back(rec.node);
  }
  im.pickle = pickle::Pickle(root);

  std::string prefix = im.options.archive_name;
  if (prefix.empty()) prefix = im.path.stem().string();
  if (prefix.empty()) prefix = "archive";
  im.specs.clear();
  im.specs.reserve(order.size() + 3);
  im.specs.push_back({prefix + "/data.pkl", im.pickle.size()});
  im.specs.push_back({prefix + "/byteorder", 6});
  for (size_t k = 0; k < order.size(); ++k) {
    im.specs.push_back(
        {prefix + "/data/" + std::to_string(k), im.records[order[k]].nbytes});
  }
  im.specs.push_back({prefix + "/version", 2});
  im.prepared = true;
  return PlanZipLayout(im.specs, im.options.zip).total_size;
}

void TorchWriter::Impl::WriteSmallRecords() {
  auto bytes = [](std::string_view s) {
    return std::as_bytes(std::span<const char>(s.data(), s.size()));
  };
  zip->Write(0, 0, bytes(pickle));
  zip->Write(1, 0, bytes("little"));
  zip->Write(specs.size() - 1, 0, bytes("3\n"));
  begun = true;
}

void TorchWriter::Begin(const Value* root) {
  Prepare(root);
  Open();
}

void TorchWriter::Open() {
  Impl& im = *impl_;
  if (!im.prepared || im.begun) {
    throw UsageError("TorchWriter::Open needs Prepare first, once (",
                     im.path.string(), ")");
  }
  im.zip.emplace(im.path, im.specs, im.options.zip, im.options.in_memory);
  im.WriteSmallRecords();
}

void TorchWriter::OpenIn(std::shared_ptr<OutputFile> file, uint64_t offset) {
  Impl& im = *impl_;
  if (!im.prepared || im.begun) {
    throw UsageError("TorchWriter::OpenIn needs Prepare first, once (",
                     im.path.string(), ")");
  }
  im.zip.emplace(std::move(file), offset, im.path, im.specs, im.options.zip);
  im.WriteSmallRecords();
}

const std::vector<const Value*>& TorchWriter::planned_tensors() const noexcept {
  return impl_->planned;
}

const std::string& TorchWriter::StorageKey(const Value* tensor) const {
  return impl_->Planned(tensor).key->s;
}

uint64_t TorchWriter::TensorBytes(const Value* tensor) const {
  return impl_->Planned(tensor).nbytes;
}

const std::string& TorchWriter::pickle_bytes() const noexcept {
  return impl_->pickle;
}

const ZipLayout& TorchWriter::layout() const {
  if (!impl_->zip) throw UsageError("TorchWriter::Begin was not called");
  return impl_->zip->layout();
}

void TorchWriter::WriteTensorData(const Value* tensor, uint64_t byte_offset,
                                  std::span<const std::byte> bytes) {
  const TensorRecord& rec = impl_->Planned(tensor);
  try {
    impl_->zip->Write(*rec.zip_index, byte_offset, bytes);
  } catch (Error& e) {
    e.AddContext("tensor with storage key ", rec.key->s);
    throw;
  }
}

void TorchWriter::WriteTensor(const Value* tensor, const FillFunction& fill,
                              size_t buffer_bytes) {
  const uint64_t total = TensorBytes(tensor);
  if (total == 0) return;
  if (buffer_bytes == 0) throw UsageError("zero buffer size");
  AlignedBuffer buf(
      static_cast<size_t>(std::min<uint64_t>(buffer_bytes, total)));
  for (uint64_t done = 0; done < total;) {
    const size_t n =
        static_cast<size_t>(std::min<uint64_t>(buf.size(), total - done));
    std::span<std::byte> chunk(buf.data(), n);
    fill(done, chunk);
    WriteTensorData(tensor, done, chunk);
    done += n;
  }
}

void TorchWriter::Commit() {
  Impl& im = *impl_;
  if (!im.zip) throw UsageError("TorchWriter::Begin was not called");
  im.zip->Commit();
}

void TorchWriter::Commit(ZipWriter::PendingRun& carry) {
  Impl& im = *impl_;
  if (!im.zip) throw UsageError("TorchWriter::Begin was not called");
  im.zip->Commit(carry);
}

std::string TorchWriter::Contents() const {
  if (!impl_->zip) throw UsageError("TorchWriter::Begin was not called");
  return impl_->zip->Contents();
}

namespace {

// Copies the sub-view of `t` with `shape`, `stride` and storage element
// `offset` to byte `out_offset` of `node`: blocks of dim-0 slices that fit
// the buffer, or each slice on its own (recursing into dim 1) when one slice
// is larger than the buffer.
void CopyStrided(const TorchFile& source, const TensorInfo& t,
                 std::span<const int64_t> shape,
                 std::span<const int64_t> stride, int64_t offset,
                 uint64_t out_offset, TorchWriter& writer,
                 const pickle::Value* node, AlignedBuffer& scratch,
                 size_t buffer_bytes) {
  const size_t esize = ElementSize(t.dtype);
  int64_t slice_numel = 1;
  for (size_t d = 1; d < shape.size(); ++d) slice_numel *= shape[d];
  const uint64_t slice_bytes = static_cast<uint64_t>(slice_numel) * esize;
  if (slice_bytes == 0) return;
  if (slice_bytes > buffer_bytes && shape.size() > 1) {
    for (int64_t i = 0; i < shape[0]; ++i) {
      CopyStrided(source, t, shape.subspan(1), stride.subspan(1),
                  offset + i * stride[0], out_offset + i * slice_bytes, writer,
                  node, scratch, buffer_bytes);
    }
    return;
  }
  const int64_t rows_per_block =
      static_cast<int64_t>(std::max<uint64_t>(buffer_bytes / slice_bytes, 1));
  scratch.Reserve(static_cast<size_t>(
      std::min<uint64_t>(rows_per_block, shape[0]) * slice_bytes));
  TensorInfo block = t;  // keeps the storage and path for error messages
  block.shape.assign(shape.begin(), shape.end());
  block.stride.assign(stride.begin(), stride.end());
  for (int64_t row = 0; row < shape[0]; row += rows_per_block) {
    block.shape[0] = std::min(rows_per_block, shape[0] - row);
    block.storage_offset = offset + row * stride[0];
    block.numel = block.shape[0] * slice_numel;
    block.nbytes = static_cast<uint64_t>(block.numel) * esize;
    block.contiguous = IsContiguous(block.shape, block.stride);
    std::span<std::byte> dst(scratch.data(), static_cast<size_t>(block.nbytes));
    source.ReadTensor(block, dst);
    writer.WriteTensorData(node, out_offset + row * slice_bytes, dst);
  }
}

}  // namespace

void CopyTensorData(const TorchFile& source, const TensorInfo& t,
                    TorchWriter& writer, const pickle::Value* node,
                    AlignedBuffer& scratch, size_t buffer_bytes) {
  if (t.nbytes == 0) return;
  buffer_bytes = std::max<size_t>(buffer_bytes, 4096);
  const size_t esize = ElementSize(t.dtype);
  if (t.contiguous) {
    const uint64_t chunk_elems = std::max<uint64_t>(buffer_bytes / esize, 1);
    scratch.Reserve(
        static_cast<size_t>(std::min<uint64_t>(chunk_elems * esize, t.nbytes)));
    for (int64_t done = 0; done < t.numel;) {
      const int64_t n = static_cast<int64_t>(std::min<uint64_t>(
          chunk_elems, static_cast<uint64_t>(t.numel - done)));
      std::span<std::byte> chunk(scratch.data(),
                                 static_cast<size_t>(n) * esize);
      source.ReadTensorRange(t, done, n, chunk);
      writer.WriteTensorData(node, static_cast<uint64_t>(done) * esize, chunk);
      done += n;
    }
    return;
  }
  // Not contiguous, so at least one dim (IsContiguous holds for 0-d views).
  CopyStrided(source, t, t.shape, t.stride, t.storage_offset, 0, writer, node,
              scratch, buffer_bytes);
}

void WriteCompactCopy(const TorchFile& source,
                      const std::filesystem::path& path,
                      const TorchWriterOptions& options, size_t buffer_bytes) {
  TorchWriter writer(path, options);
  std::vector<std::pair<const TensorInfo*, const Value*>> copies;
  Value* root =
      writer.arena().Copy(source.root(), [&](const Value* v) -> Value* {
        const TensorInfo* t = source.FindTensor(v);
        if (t == nullptr) return nullptr;
        Value* node;
        if (v == t->node) {
          node = writer.NewTensorLike(*t);
        } else {  // the inner tensor of a Parameter, met on its own
          TensorSpec spec{t->dtype, t->shape, false, false, t->device()};
          node = writer.NewTensor(spec);
        }
        copies.emplace_back(t, node);
        return node;
      });
  writer.Begin(root);
  // One buffer, reused: fresh large allocations cost a page fault per page.
  AlignedBuffer buf;
  for (const auto& [t, node] : copies) {
    CopyTensorData(source, *t, writer, node, buf, buffer_bytes);
  }
  writer.Commit();
}

}  // namespace ucp::torchfile
