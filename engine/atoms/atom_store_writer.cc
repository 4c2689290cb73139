#include <hdf5.h>

#include <algorithm>
#include <array>
#include <mutex>
#include <optional>
#include <set>
#include <unordered_map>
#include <unordered_set>

#include "engine/atoms/atom_store.h"
#include "engine/atoms/h5/h5.h"
#include "engine/atoms/schema.h"
#include "engine/core/aligned_buffer.h"
#include "engine/core/error.h"
#include "engine/core/file.h"
#include "engine/core/hash.h"
#include "engine/json/json.h"

namespace ucp::atoms {

using namespace internal;  // NOLINT(build/namespaces): schema names.

namespace {

enum class Phase { kPlanning, kAllocated, kCommitted };

uint64_t DatasetBytes(DType dtype, const Shape& shape, std::string_view what) {
  std::optional<int64_t> n = CheckedNumElements(shape);
  UCP_CHECK(n.has_value(), "invalid shape for ", what);
  uint64_t elements = static_cast<uint64_t>(*n);
  uint64_t size = ElementSize(dtype);
  UCP_CHECK(elements == 0 || elements <= UINT64_MAX / size,
            "dataset too large: ", what);
  return elements * size;
}

h5::Dataspace MakeSpace(const Shape& shape) {
  if (shape.empty()) {
    return h5::Dataspace(H5Screate(H5S_SCALAR), "create scalar dataspace");
  }
  std::vector<hsize_t> dims(shape.begin(), shape.end());
  return h5::Dataspace(
      H5Screate_simple(static_cast<int>(dims.size()), dims.data(), nullptr),
      "create dataspace");
}

}  // namespace

struct AtomStoreWriter::Impl {
  explicit Impl(OutputFile output) : out(std::move(output)) {}

  // The file written: the own temporary file, or another process's.
  File& file() { return shared ? *shared : out.file(); }

  DatasetId AddDataset(DatasetInfo info) {
    UCP_CHECK(phase == Phase::kPlanning, "dataset ", info.path,
              " declared after Allocate");
    UCP_CHECK(datasets.size() < UINT32_MAX, "too many datasets");
    UCP_CHECK(dataset_paths.insert(info.path).second, "duplicate dataset ",
              info.path);
    info.id = static_cast<DatasetId>(datasets.size());
    info.nbytes = DatasetBytes(info.dtype, info.shape, info.path);
    datasets.push_back(std::move(info));
    return datasets.back().id;
  }

  const ParamInfo& Param(std::string_view fqn) const {
    auto it = param_index.find(std::string(fqn));
    UCP_CHECK(it != param_index.end(), "param ", fqn, " was not declared");
    return params[it->second];
  }

  DatasetInfo& Dataset(DatasetId id) {
    UCP_CHECK(id < datasets.size(), "dataset id ", id, " out of range");
    return datasets[id];
  }

  void WriteRootAttrs(h5::Hid file) const {
    h5::WriteStringAttr(file, kAttrFormat, kFormatName);
    h5::WriteInt64Attr(file, kAttrVersion, kFormatVersion);
    h5::WriteInt64Attr(file, kAttrIteration, root.iteration);
    h5::WriteInt64Attr(file, kAttrConsumedSamples, root.consumed_samples);
    h5::WriteStringAttr(file, kAttrSource, root.source);
    h5::WriteStringAttr(file, kAttrModel, root.model);
    h5::WriteStringAttr(file, kAttrLayout, root.layout);
    h5::WriteStringAttr(file, kAttrOptimizer, root.optimizer);
    h5::WriteStringAttr(file, kAttrScheduler, root.scheduler);
    h5::WriteStringAttr(file, kAttrArgs, root.args);
    h5::WriteStringAttr(file, kAttrTraining, root.training);
    for (const auto& [name, value] : root.extra_strings) {
      h5::WriteStringAttr(file, name.c_str(), value);
    }
    for (const auto& [name, value] : root.extra_ints) {
      h5::WriteInt64Attr(file, name.c_str(), value);
    }
  }

  void CreateParamGroup(h5::Hid file, h5::Hid lcpl, h5::Hid gcpl,
                        const ParamInfo& p) const {
    std::string path = ParamPath(p.fqn);
    h5::Group g(H5Gcreate2(file, path.c_str(), lcpl, gcpl, H5P_DEFAULT),
                "create group", path);
    h5::WriteInt64ArrayAttr(g.get(), kAttrShape, p.shape);
    h5::WriteStringAttr(g.get(), kAttrDType, DTypeName(p.dtype));
    h5::WriteStringAttr(g.get(), kAttrRule, p.rule);
    h5::WriteStringAttr(g.get(), kAttrKind, ParamKindName(p.kind));
    h5::WriteInt64Attr(g.get(), kAttrGroup, p.group);
    h5::WriteInt64Attr(g.get(), kAttrOrder, p.order);
    json::Value copies = json::Value::Array();
    for (const std::string& c : p.tied_copies) copies.Append(c);
    h5::WriteStringAttr(g.get(), kAttrTiedCopies, copies.Dump());
    h5::WriteInt64Attr(g.get(), kAttrFrozen, p.frozen ? 1 : 0);
    g.Close("close group", path);
  }

  void CreateDatasets(h5::Hid file, h5::Hid lcpl) {
    h5::PropertyList dcpl(H5Pcreate(H5P_DATASET_CREATE),
                          "create dataset creation list");
    h5::Check(H5Pset_layout(dcpl.get(), H5D_CONTIGUOUS), "set layout");
    h5::Check(H5Pset_alloc_time(dcpl.get(), H5D_ALLOC_TIME_EARLY),
              "set allocation time");
    h5::Check(H5Pset_fill_time(dcpl.get(), H5D_FILL_TIME_NEVER),
              "set fill time");
    // No modification times: smaller object headers, reproducible files.
    h5::Check(H5Pset_obj_track_times(dcpl.get(), false), "set time tracking");
    std::array<std::optional<h5::Datatype>, kNumDTypes> types;
    for (DatasetInfo& d : datasets) {
      std::optional<h5::Datatype>& type = types[static_cast<size_t>(d.dtype)];
      if (!type) type = StorageType(d.dtype);
      h5::Dataspace space = MakeSpace(d.shape);
      h5::Dataset ds(H5Dcreate2(file, d.path.c_str(), type->get(), space.get(),
                                lcpl, dcpl.get(), H5P_DEFAULT),
                     "create dataset", d.path);
      h5::WriteStringAttr(ds.get(), kAttrDType, DTypeName(d.dtype));
      h5::WriteUInt64Attr(ds.get(), kAttrXxh3, 0);  // Set by Commit.
      if (d.nbytes > 0) {
        haddr_t offset = H5Dget_offset(ds.get());
        if (offset == HADDR_UNDEF) {
          h5::Fail("get file offset of dataset", d.path);
        }
        UCP_CHECK(H5Dget_storage_size(ds.get()) == d.nbytes, "dataset ", d.path,
                  " has ", H5Dget_storage_size(ds.get()),
                  " bytes of storage, expected ", d.nbytes);
        d.offset = offset;
      }
      ds.Close("close dataset", d.path);
    }
  }

  void Allocate() {
    UCP_CHECK(phase == Phase::kPlanning, "Allocate called twice");
    UCP_CHECK(!attaches, "Allocate of a shared writer (Attach instead)");
    h5::Silence();
    {
      h5::PropertyList fapl = FileAccessList(FileMode::kWrite);
      // No modification times anywhere: smaller object headers, and the
      // file's bytes depend only on what it holds.
      h5::PropertyList fcpl(H5Pcreate(H5P_FILE_CREATE),
                            "create file creation list");
      h5::Check(H5Pset_obj_track_times(fcpl.get(), false), "set time tracking");
      h5::File file(H5Fcreate(out.temp_path().c_str(), H5F_ACC_TRUNC,
                              fcpl.get(), fapl.get()),
                    "create HDF5 file");
      WriteRootAttrs(file.get());
      h5::PropertyList lcpl = LinkCreationList();
      h5::PropertyList gcpl(H5Pcreate(H5P_GROUP_CREATE),
                            "create group creation list");
      h5::Check(H5Pset_obj_track_times(gcpl.get(), false), "set time tracking");
      auto create_group = [&](const std::string& path) {
        h5::Group g(H5Gcreate2(file.get(), path.c_str(), lcpl.get(), gcpl.get(),
                               H5P_DEFAULT),
                    "create group", path);
      };
      for (const char* group : {kParamsGroup, kBuffersGroup, kOpaqueGroup}) {
        create_group(group);
      }
      for (const ParamInfo& p : params) {
        CreateParamGroup(file.get(), lcpl.get(), gcpl.get(), p);
      }
      // Pad groups and opaque subgroups; a parent sorts before its children.
      std::set<std::string> groups(opaque_groups.begin(), opaque_groups.end());
      for (const DatasetInfo& d : datasets) {
        if (d.kind == DatasetKind::kPad) {
          groups.insert(ParamPath(d.fqn) + "/" + kPadGroup);
        }
      }
      for (const std::string& g : groups) create_group(g);
      CreateDatasets(file.get(), lcpl.get());
      file.Close("close HDF5 file");
    }
    file_size = out.file().Size();
    for (const DatasetInfo& d : datasets) {
      UCP_CHECK(d.offset + d.nbytes <= file_size, "dataset ", d.path,
                " ends at ", d.offset + d.nbytes, " beyond the file size ",
                file_size);
    }
    out.file().Allocate(file_size);
    hashes.assign(datasets.size(), 0);
    hashed.assign(datasets.size(), false);
    phase = Phase::kAllocated;
  }

  void Commit() {
    UCP_CHECK(phase == Phase::kAllocated, "Commit needs an allocated store");
    UCP_CHECK(!shared, "Commit of a store another process allocated");
    {
      std::lock_guard lock(hash_mutex);
      for (const DatasetInfo& d : datasets) {
        if (!hashed[d.id] && d.nbytes == 0) {
          hashes[d.id] = Xxh3(nullptr, 0);
          hashed[d.id] = true;
        }
        UCP_CHECK(hashed[d.id], "dataset ", d.path, " has no xxh3 (SetHash)");
        datasets[d.id].xxh3 = hashes[d.id];
      }
    }
    h5::Silence();
    {
      h5::PropertyList fapl = FileAccessList(FileMode::kWrite);
      h5::File file(H5Fopen(out.temp_path().c_str(), H5F_ACC_RDWR, fapl.get()),
                    "reopen HDF5 file");
      for (const DatasetInfo& d : datasets) {
        h5::Dataset ds(H5Dopen2(file.get(), d.path.c_str(), H5P_DEFAULT),
                       "open dataset", d.path);
        h5::OverwriteUInt64Attr(ds.get(), kAttrXxh3, d.xxh3);
      }
      file.Close("close HDF5 file");
    }
    out.Commit();
    phase = Phase::kCommitted;
  }

  OutputFile out;  // First member: destroyed (and removed) last.
  // Attach: another process's temporary file (never removed here).
  std::optional<File> shared;
  bool attaches = false;  // made by CreateShared
  Phase phase = Phase::kPlanning;
  RootInfo root;
  std::vector<ParamInfo> params;
  std::unordered_map<std::string, size_t> param_index;
  std::vector<DatasetInfo> datasets;
  std::unordered_set<std::string> dataset_paths;
  std::unordered_set<std::string> opaque_groups;
  uint64_t file_size = 0;
  std::mutex hash_mutex;
  std::vector<uint64_t> hashes;
  std::vector<bool> hashed;
};

AtomStoreWriter::AtomStoreWriter(std::unique_ptr<Impl> impl) noexcept
    : impl_(std::move(impl)) {}
AtomStoreWriter::AtomStoreWriter(AtomStoreWriter&&) noexcept = default;
AtomStoreWriter& AtomStoreWriter::operator=(AtomStoreWriter&&) noexcept =
    default;
AtomStoreWriter::~AtomStoreWriter() = default;

AtomStoreWriter AtomStoreWriter::Create(
    const std::filesystem::path& final_path) {
  try {
    return AtomStoreWriter(std::make_unique<Impl>(OutputFile(final_path)));
  } catch (Error& e) {
    e.AddContext("universal file ", final_path.string());
    throw;
  }
}

AtomStoreWriter AtomStoreWriter::CreateShared(
    const std::filesystem::path& final_path) {
  auto impl = std::make_unique<Impl>(OutputFile::InMemory(final_path));
  impl->attaches = true;
  return AtomStoreWriter(std::move(impl));
}

void AtomStoreWriter::Attach(const std::filesystem::path& temp_path,
                             std::span<const uint64_t> offsets) {
  Impl& m = *impl_;
  UCP_CHECK(m.attaches && m.phase == Phase::kPlanning,
            "Attach of a writer not made by CreateShared, or twice");
  UCP_CHECK(offsets.size() == m.datasets.size(), "Attach with ", offsets.size(),
            " offsets for ", m.datasets.size(), " datasets");
  m.shared.emplace(File::OpenWrite(temp_path));
  m.shared->SetStreamingWriteback(DurableWrites());
  m.file_size = m.shared->Size();
  for (DatasetInfo& d : m.datasets) {
    d.offset = d.nbytes == 0 ? 0 : offsets[d.id];
    if (d.offset + d.nbytes > m.file_size || d.offset + d.nbytes < d.offset) {
      throw IoError("universal file ", temp_path.string(), ": dataset ", d.path,
                    " ends beyond the allocated ", m.file_size,
                    " bytes (written by another process?)");
    }
  }
  m.hashes.assign(m.datasets.size(), 0);
  m.hashed.assign(m.datasets.size(), false);
  m.phase = Phase::kAllocated;
}

void AtomStoreWriter::SyncWrites() {
  UCP_CHECK(impl_->phase == Phase::kAllocated,
            "SyncWrites outside Allocate..Commit");
  if (DurableWrites()) impl_->file().Sync();
}

const std::filesystem::path& AtomStoreWriter::final_path() const noexcept {
  return impl_->out.final_path();
}

const std::filesystem::path& AtomStoreWriter::temp_path() const noexcept {
  return impl_->shared ? impl_->shared->path() : impl_->out.temp_path();
}

void AtomStoreWriter::SetRoot(RootInfo root) {
  UCP_CHECK(impl_->phase == Phase::kPlanning, "SetRoot after Allocate");
  for (const auto& [name, value] : root.extra_strings) {
    UCP_CHECK(!name.empty() && !IsFixedRootAttr(name),
              "invalid extra root attribute name '", name, "'");
  }
  for (const auto& [name, value] : root.extra_ints) {
    UCP_CHECK(!name.empty() && !IsFixedRootAttr(name) &&
                  !root.extra_strings.contains(name),
              "invalid extra root attribute name '", name, "'");
  }
  impl_->root = std::move(root);
}

void AtomStoreWriter::AddParam(ParamInfo param) {
  UCP_CHECK(impl_->phase == Phase::kPlanning, "param ", param.fqn,
            " declared after Allocate");
  UCP_CHECK(!param.fqn.empty(), "empty param name");
  UCP_CHECK(CheckedNumElements(param.shape).has_value(), "param ", param.fqn,
            " has an invalid shape");
  bool inserted =
      impl_->param_index.emplace(param.fqn, impl_->params.size()).second;
  UCP_CHECK(inserted, "duplicate param ", param.fqn);
  impl_->params.push_back(std::move(param));
}

DatasetId AtomStoreWriter::AddAtom(std::string_view fqn,
                                   std::string_view state_kind, DType dtype,
                                   Shape shape) {
  const ParamInfo& p = impl_->Param(fqn);
  UCP_CHECK(!state_kind.empty(), "empty state kind for param ", fqn);
  UCP_CHECK(shape == p.shape || shape.empty(), "atom ", fqn, "/", state_kind,
            " shape differs from the param's shape");
  DatasetInfo d;
  d.kind = DatasetKind::kAtom;
  d.fqn = fqn;
  d.state_kind = state_kind;
  d.path = AtomPath(fqn, state_kind);
  d.dtype = dtype;
  d.shape = std::move(shape);
  return impl_->AddDataset(std::move(d));
}

DatasetId AtomStoreWriter::AddPadAtom(std::string_view fqn,
                                      std::string_view state_kind, DType dtype,
                                      Shape shape) {
  const ParamInfo& p = impl_->Param(fqn);
  UCP_CHECK(!state_kind.empty(), "empty state kind for param ", fqn);
  UCP_CHECK(shape.size() == p.shape.size(), "pad atom ", fqn, "/", state_kind,
            " rank differs from the param's rank");
  DatasetInfo d;
  d.kind = DatasetKind::kPad;
  d.fqn = fqn;
  d.state_kind = state_kind;
  d.path = PadPath(fqn, state_kind);
  d.dtype = dtype;
  d.shape = std::move(shape);
  return impl_->AddDataset(std::move(d));
}

DatasetId AtomStoreWriter::AddBuffer(std::string_view fqn, DType dtype,
                                     Shape shape) {
  UCP_CHECK(!fqn.empty(), "empty buffer name");
  DatasetInfo d;
  d.kind = DatasetKind::kBuffer;
  d.fqn = fqn;
  d.path = BufferPath(fqn);
  d.dtype = dtype;
  d.shape = std::move(shape);
  return impl_->AddDataset(std::move(d));
}

DatasetId AtomStoreWriter::AddOpaque(std::string_view key,
                                     uint64_t size_bytes) {
  std::optional<std::string> path = OpaquePath(key);
  UCP_CHECK(path.has_value(), "opaque key '", key, "' has an empty part");
  UCP_CHECK(size_bytes <= static_cast<uint64_t>(INT64_MAX),
            "opaque blob too large");
  UCP_CHECK(!impl_->opaque_groups.contains(*path), "opaque key '", key,
            "' is also a prefix of another key");
  std::vector<std::string> prefixes;
  for (size_t slash = path->find('/', sizeof(kOpaqueGroup));
       slash != std::string::npos; slash = path->find('/', slash + 1)) {
    prefixes.push_back(path->substr(0, slash));
    UCP_CHECK(!impl_->dataset_paths.contains(prefixes.back()), "opaque key '",
              key, "' lies under another opaque key");
  }
  UCP_CHECK(prefixes.size() <= 32, "opaque key '", key,
            "' is nested deeper than 32 levels");
  DatasetInfo d;
  d.kind = DatasetKind::kOpaque;
  d.fqn = key;
  d.path = std::move(*path);
  d.dtype = DType::kUInt8;
  d.shape = {static_cast<int64_t>(size_bytes)};
  DatasetId id = impl_->AddDataset(std::move(d));
  impl_->opaque_groups.insert(prefixes.begin(), prefixes.end());
  return id;
}

void AtomStoreWriter::Allocate() {
  try {
    impl_->Allocate();
  } catch (Error& e) {
    e.AddContext("universal file ", impl_->out.final_path().string());
    throw;
  }
}

size_t AtomStoreWriter::num_datasets() const noexcept {
  return impl_->datasets.size();
}

const DatasetInfo& AtomStoreWriter::dataset(DatasetId id) const {
  return impl_->Dataset(id);
}

void AtomStoreWriter::Write(DatasetId id, uint64_t byte_offset,
                            std::span<const std::byte> data) {
  UCP_CHECK(impl_->phase == Phase::kAllocated,
            "Write outside Allocate..Commit");
  const DatasetInfo& d = impl_->Dataset(id);
  UCP_CHECK(byte_offset <= d.nbytes && data.size() <= d.nbytes - byte_offset,
            "write of ", data.size(), " bytes at ", byte_offset,
            " outside dataset ", d.path, " of ", d.nbytes, " bytes");
  if (data.empty()) return;
  impl_->file().WriteExact(data.data(), data.size(), d.offset + byte_offset);
}

void AtomStoreWriter::SetHash(DatasetId id, uint64_t xxh3) {
  UCP_CHECK(impl_->phase == Phase::kAllocated,
            "SetHash outside Allocate..Commit");
  UCP_CHECK(id < impl_->datasets.size(), "dataset id ", id, " out of range");
  std::lock_guard lock(impl_->hash_mutex);
  impl_->hashes[id] = xxh3;
  impl_->hashed[id] = true;
}

uint64_t AtomStoreWriter::HashWritten(DatasetId id) {
  UCP_CHECK(impl_->phase == Phase::kAllocated,
            "HashWritten outside Allocate..Commit");
  const DatasetInfo& d = impl_->Dataset(id);
  constexpr uint64_t kChunk = 4 << 20;
  Xxh3Hasher hasher;
  AlignedBuffer buf(std::min(kChunk, std::max<uint64_t>(d.nbytes, 1)));
  for (uint64_t done = 0; done < d.nbytes;) {
    size_t n =
        static_cast<size_t>(std::min<uint64_t>(buf.size(), d.nbytes - done));
    impl_->file().ReadExact(buf.data(), n, d.offset + done);
    hasher.Update(buf.data(), n);
    done += n;
  }
  uint64_t hash = hasher.Digest();
  SetHash(id, hash);
  return hash;
}

void AtomStoreWriter::Commit() {
  try {
    impl_->Commit();
  } catch (Error& e) {
    e.AddContext("universal file ", impl_->out.final_path().string());
    throw;
  }
}

}  // namespace ucp::atoms
