#include <fcntl.h>
#include <hdf5.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <new>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <tuple>
#include <unordered_map>

#include "engine/atoms/atom_store.h"
#include "engine/atoms/h5/h5.h"
#include "engine/atoms/names.h"
#include "engine/atoms/schema.h"
#include "engine/core/aligned_buffer.h"
#include "engine/core/error.h"
#include "engine/core/file.h"
#include "engine/core/hash.h"
#include "engine/json/json.h"

namespace ucp::atoms {

using namespace internal;  // NOLINT(build/namespaces): schema names.

namespace {

// Decodes a link name; only the canonical encoding is accepted, so that
// lookups, which escape the name they are given, find every stored name.
std::string Unescape(std::string_view link, std::string_view where,
                     std::string_view reserved = {}) {
  std::optional<std::string> name = UnescapeLinkName(link);
  if (!name || EscapeLinkName(*name, reserved) != link) {
    throw FormatError(where, ": malformed escaped name '", link, "'");
  }
  return *name;
}

template <typename T>
T Require(std::optional<T> value, std::string_view where, const char* attr) {
  if (!value) throw FormatError(where, ": attribute ", attr, " is missing");
  return std::move(*value);
}

DType ParseDType(const std::string& name, std::string_view where) {
  std::optional<DType> dtype = DTypeFromName(name);
  if (!dtype) {
    throw FormatError(where, ": unknown dtype attribute '", name, "'");
  }
  return *dtype;
}

// Objects below a group: opened with H5Oopen, typed with H5Iget_type.
H5I_type_t ObjectType(const h5::Object& obj, const std::string& path) {
  H5I_type_t type = H5Iget_type(obj.get());
  if (type == H5I_BADID) h5::Fail("get object type of", path);
  return type;
}

// Scans the HDF5 file; collects datasets (ids assigned later).
class Scanner {
 public:
  Scanner(h5::Hid file, uint64_t file_size)
      : file_(file), file_size_(file_size) {}

  RootInfo ReadRoot() {
    std::optional<std::string> format = attrs_.String(file_, kAttrFormat);
    if (!format) {
      throw FormatError(
          "not a ucp universal file (root attribute ucp_format is missing)");
    }
    if (*format != kFormatName) {
      throw FormatError("not a ucp universal file (ucp_format is '", *format,
                        "', expected '", kFormatName, "')");
    }
    std::optional<int64_t> version = attrs_.Int64(file_, kAttrVersion);
    if (!version) {
      throw FormatError("root attribute ucp_version is missing");
    }
    if (*version < kMinFormatVersion || *version > kFormatVersion) {
      throw FormatError("unsupported ucp_version ", *version,
                        " (this build reads versions ", kMinFormatVersion,
                        " to ", kFormatVersion, ")");
    }
    RootInfo root;
    root.iteration =
        Require(attrs_.Int64(file_, kAttrIteration), "/", kAttrIteration);
    root.consumed_samples = Require(attrs_.Int64(file_, kAttrConsumedSamples),
                                    "/", kAttrConsumedSamples);
    auto text = [&](const char* name) {
      return attrs_.String(file_, name).value_or("");
    };
    root.source = text(kAttrSource);
    root.model = text(kAttrModel);
    root.layout = text(kAttrLayout);
    root.optimizer = text(kAttrOptimizer);
    root.scheduler = text(kAttrScheduler);
    root.args = text(kAttrArgs);
    root.training = text(kAttrTraining);  // absent in version 1
    version_ = *version;
    root.version = *version;
    for (const std::string& name : h5::AttrNames(file_)) {
      if (IsFixedRootAttr(name)) continue;
      switch (attrs_.ScalarClass(file_, name.c_str())) {
        case h5::AttrReader::Class::kString:
          root.extra_strings[name] = *attrs_.String(file_, name.c_str());
          break;
        case h5::AttrReader::Class::kInteger:
          root.extra_ints[name] = *attrs_.Int64(file_, name.c_str());
          break;
        case h5::AttrReader::Class::kOther:
          break;
      }
    }
    return root;
  }

  void ScanParams() {
    std::optional<h5::Group> params = OpenTopGroup(kParamsGroup);
    if (!params) return;
    for (const std::string& link : h5::LinkNames(params->get())) {
      std::string path = std::string(kParamsGroup) + "/" + link;
      std::string fqn = Unescape(link, path);
      h5::Object obj(H5Oopen(params->get(), link.c_str(), H5P_DEFAULT), "open",
                     path);
      if (ObjectType(obj, path) != H5I_GROUP) {
        throw FormatError(path, ": expected a param group");
      }
      ParamInfo p = ReadParamAttrs(obj.get(), path);
      p.fqn = std::move(fqn);
      for (const std::string& child : h5::LinkNames(obj.get())) {
        std::string child_path = path + "/" + child;
        h5::Object c(H5Oopen(obj.get(), child.c_str(), H5P_DEFAULT), "open",
                     child_path);
        if (child == kPadGroup) {
          if (ObjectType(c, child_path) != H5I_GROUP) {
            throw FormatError(child_path, ": expected the pad group");
          }
          for (const std::string& pad : h5::LinkNames(c.get())) {
            std::string pad_path = child_path + "/" + pad;
            h5::Object d(H5Oopen(c.get(), pad.c_str(), H5P_DEFAULT), "open",
                         pad_path);
            DatasetInfo info = ScanDataset(d, pad_path);
            info.kind = DatasetKind::kPad;
            info.fqn = p.fqn;
            info.state_kind = Unescape(pad, pad_path);
            if (info.shape.size() != p.shape.size()) {
              throw FormatError(pad_path, ": rank ", info.shape.size(),
                                " differs from the param's shape attribute");
            }
            if (info.shape.empty()) {
              throw FormatError(pad_path,
                                ": padding rows of a 0-d param (a pad dataset "
                                "needs at least one dim)");
            }
            datasets_.push_back(std::move(info));
          }
          continue;
        }
        DatasetInfo info = ScanDataset(c, child_path);
        info.kind = DatasetKind::kAtom;
        info.fqn = p.fqn;
        info.state_kind = Unescape(child, child_path, kPadGroup);
        if (info.shape != p.shape && !info.shape.empty()) {
          throw FormatError(child_path, ": extent ", ShapeString(info.shape),
                            " differs from the param's shape attribute ",
                            ShapeString(p.shape));
        }
        datasets_.push_back(std::move(info));
      }
      params_.push_back(StoredParam{std::move(p), {}, {}});
    }
  }

  void ScanBuffers() {
    std::optional<h5::Group> buffers = OpenTopGroup(kBuffersGroup);
    if (!buffers) return;
    for (const std::string& link : h5::LinkNames(buffers->get())) {
      std::string path = std::string(kBuffersGroup) + "/" + link;
      h5::Object obj(H5Oopen(buffers->get(), link.c_str(), H5P_DEFAULT), "open",
                     path);
      DatasetInfo info = ScanDataset(obj, path);
      info.kind = DatasetKind::kBuffer;
      info.fqn = Unescape(link, path);
      datasets_.push_back(std::move(info));
    }
  }

  void ScanOpaque() {
    std::optional<h5::Group> opaque = OpenTopGroup(kOpaqueGroup);
    if (!opaque) return;
    ScanOpaqueGroup(opaque->get(), kOpaqueGroup, "", 0);
  }

  std::vector<StoredParam>& params() { return params_; }
  std::vector<DatasetInfo>& datasets() { return datasets_; }

 private:
  int64_t version_ = kFormatVersion;

  std::optional<h5::Group> OpenTopGroup(const char* name) {
    if (!h5::HasLink(file_, name + 1)) return std::nullopt;
    return h5::Group(H5Gopen2(file_, name, H5P_DEFAULT), "open group", name);
  }

  void ScanOpaqueGroup(h5::Hid group, const std::string& path,
                       const std::string& key_prefix, int depth) {
    // Bounds the recursion.
    constexpr int kMaxDepth = 32;
    if (depth > kMaxDepth) {
      throw FormatError(path, ": opaque keys nested deeper than ", kMaxDepth,
                        " levels");
    }
    // Each group once: hard links could form cycles, or share subgroups so
    // that a few dozen groups unfold into billions of paths.
    if (!opaque_groups_.insert(h5::IdentityOf(group)).second) {
      throw FormatError(path,
                        ": a group linked more than once (a hard-link cycle "
                        "or a shared subgroup)");
    }
    for (const std::string& link : h5::LinkNames(group)) {
      std::string child_path = path + "/" + link;
      std::string key = key_prefix + Unescape(link, child_path);
      h5::Object obj(H5Oopen(group, link.c_str(), H5P_DEFAULT), "open",
                     child_path);
      if (ObjectType(obj, child_path) == H5I_GROUP) {
        ScanOpaqueGroup(obj.get(), child_path, key + "/", depth + 1);
        continue;
      }
      DatasetInfo info = ScanDataset(obj, child_path);
      info.kind = DatasetKind::kOpaque;
      info.fqn = std::move(key);
      if (info.dtype != DType::kUInt8 || info.shape.size() != 1) {
        throw FormatError(child_path,
                          ": an opaque blob must be a 1-D uint8 dataset");
      }
      datasets_.push_back(std::move(info));
    }
  }

  ParamInfo ReadParamAttrs(h5::Hid group, const std::string& path) {
    ParamInfo p;
    p.shape = Require(attrs_.Int64Array(group, kAttrShape), path, kAttrShape);
    if (!CheckedNumElements(p.shape)) {
      throw FormatError(path, ": invalid shape attribute");
    }
    p.dtype = ParseDType(
        Require(attrs_.String(group, kAttrDType), path, kAttrDType), path);
    p.rule = Require(attrs_.String(group, kAttrRule), path, kAttrRule);
    std::string kind =
        Require(attrs_.String(group, kAttrKind), path, kAttrKind);
    if (kind == "param") {
      p.kind = ParamKind::kParam;
    } else if (kind == "buffer") {
      p.kind = ParamKind::kBuffer;
    } else {
      throw FormatError(path, ": kind attribute is '", kind,
                        "', expected 'param' or 'buffer'");
    }
    p.group = Require(attrs_.Int64(group, kAttrGroup), path, kAttrGroup);
    p.order = Require(attrs_.Int64(group, kAttrOrder), path, kAttrOrder);
    const std::string copies =
        Require(attrs_.String(group, kAttrTiedCopies), path, kAttrTiedCopies);
    try {
      const json::Value list = json::Value::Parse(copies);
      for (const json::Value& c : list.items())
        p.tied_copies.push_back(c.AsString());
    } catch (const Error& e) {
      throw FormatError(path, ": attribute ", kAttrTiedCopies,
                        " is not a JSON list of names: ", e.what());
    }
    // Version 1 has no frozen params.
    p.frozen = version_ >= 2 && Require(attrs_.Int64(group, kAttrFrozen), path,
                                        kAttrFrozen) != 0;
    return p;
  }

  const h5::Datatype& Expected(DType dtype) {
    std::optional<h5::Datatype>& t = types_[static_cast<size_t>(dtype)];
    if (!t) t = StorageType(dtype);
    return *t;
  }

  static void CheckContiguous(hid_t ds, const std::string& path) {
    h5::PropertyList dcpl(H5Dget_create_plist(ds), "get creation list of",
                          path);
    H5D_layout_t layout = H5Pget_layout(dcpl.get());
    if (layout < 0) h5::Fail("get layout of", path);
    if (layout != H5D_CONTIGUOUS) {
      throw FormatError(
          path, ": has ",
          layout == H5D_CHUNKED   ? "chunked"
          : layout == H5D_COMPACT ? "compact"
                                  : "non-contiguous",
          " layout; ucp needs contiguous datasets (no compression) to read "
          "them at file offsets");
    }
  }

  DatasetInfo ScanDataset(const h5::Object& obj, const std::string& path) {
    if (ObjectType(obj, path) != H5I_DATASET) {
      throw FormatError(path, ": expected a dataset");
    }
    hid_t ds = obj.get();
    DatasetInfo info;
    info.path = path;

    info.dtype = ParseDType(
        Require(attrs_.String(ds, kAttrDType), path, kAttrDType), path);
    info.xxh3 = Require(attrs_.UInt64(ds, kAttrXxh3), path, kAttrXxh3);

    h5::Datatype type(H5Dget_type(ds), "get datatype of", path);
    htri_t same = H5Tequal(type.get(), Expected(info.dtype).get());
    h5::Check(same, "compare datatypes of", path);
    if (same == 0) {
      throw FormatError(path, ": stored as ", DescribeType(type.get()),
                        " but its dtype attribute says ", DTypeName(info.dtype),
                        " (stored as ",
                        DescribeType(Expected(info.dtype).get()), ")");
    }

    h5::Dataspace space(H5Dget_space(ds), "get dataspace of", path);
    H5S_class_t cls = H5Sget_simple_extent_type(space.get());
    if (cls == H5S_SIMPLE) {
      int rank = H5Sget_simple_extent_ndims(space.get());
      h5::Check(rank, "get rank of", path);
      std::vector<hsize_t> dims(static_cast<size_t>(rank));
      h5::Check(H5Sget_simple_extent_dims(space.get(), dims.data(), nullptr),
                "get extent of", path);
      for (hsize_t d : dims) {
        if (d > static_cast<hsize_t>(INT64_MAX)) {
          throw FormatError(path, ": extent too large");
        }
        info.shape.push_back(static_cast<int64_t>(d));
      }
    } else if (cls != H5S_SCALAR) {
      throw FormatError(path, ": has a null dataspace");
    }
    std::optional<int64_t> n = CheckedNumElements(info.shape);
    uint64_t size = ElementSize(info.dtype);
    if (!n || (*n > 0 && static_cast<uint64_t>(*n) > UINT64_MAX / size)) {
      throw FormatError(path, ": extent too large");
    }
    info.nbytes = static_cast<uint64_t>(*n) * size;
    // H5Dget_offset is defined only for allocated contiguous storage; look
    // at the (costly to fetch) creation list only if there is none.
    haddr_t offset = H5Dget_offset(ds);
    if (offset == HADDR_UNDEF) H5Eclear2(H5E_DEFAULT);
    if (offset == HADDR_UNDEF || info.nbytes == 0) CheckContiguous(ds, path);
    if (info.nbytes > 0) {
      if (offset == HADDR_UNDEF) {
        throw FormatError(path, ": has no allocated contiguous storage");
      }
      info.offset = offset;
      if (info.offset > file_size_ || info.nbytes > file_size_ - info.offset) {
        throw FormatError(path, ": its bytes end at ",
                          info.offset + info.nbytes, " but the file has only ",
                          file_size_, " bytes (truncated file?)");
      }
    }
    return info;
  }

  h5::Hid file_;
  uint64_t file_size_;
  h5::AttrReader attrs_;
  std::vector<StoredParam> params_;
  std::vector<DatasetInfo> datasets_;
  std::array<std::optional<h5::Datatype>, kNumDTypes> types_;
  std::set<h5::ObjectIdentity> opaque_groups_;
};

// ---- The metadata scan in a child process ---------------------------------
//
// libhdf5 1.10 is not hardened against damaged files: a corrupt length in a
// variable-length string attribute (every string attribute of the schema)
// makes H5Aread copy past a heap buffer (SIGSEGV in H5HG_read), and a flipped
// byte is enough. So the metadata is read by a forked child that sends what
// it found back through a pipe; a child killed by HDF5 becomes a FormatError
// instead of taking ucp down. The parent only initialises the library.
// Cost: a few milliseconds per Open (more in a process with a large resident
// set, whose page tables fork copies). With UCP_H5_SCAN_REUSE=N one child
// serves up to N files (fuzzing: a fresh child for each input costs more
// than the scan).

struct ScanResult {
  RootInfo root;
  std::vector<StoredParam> params;
  std::vector<DatasetInfo> datasets;
};

class Encoder {
 public:
  void U64(uint64_t v) { out_.append(reinterpret_cast<const char*>(&v), 8); }
  void I64(int64_t v) { U64(static_cast<uint64_t>(v)); }
  void Str(std::string_view s) {
    U64(s.size());
    out_.append(s);
  }
  void Ints(const std::vector<int64_t>& v) {
    U64(v.size());
    for (int64_t x : v) I64(x);
  }
  std::string& out() { return out_; }

 private:
  std::string out_;
};

class Decoder {
 public:
  explicit Decoder(std::string_view in) : in_(in) {}
  uint64_t U64() {
    UCP_CHECK(in_.size() - pos_ >= 8, "truncated metadata from the scan");
    uint64_t v;
    std::memcpy(&v, in_.data() + pos_, 8);
    pos_ += 8;
    return v;
  }
  int64_t I64() { return static_cast<int64_t>(U64()); }
  std::string Str() {
    const uint64_t n = U64();
    UCP_CHECK(in_.size() - pos_ >= n, "truncated metadata from the scan");
    std::string s(in_.substr(pos_, n));
    pos_ += n;
    return s;
  }
  std::vector<int64_t> Ints() {
    const uint64_t n = U64();
    UCP_CHECK(n <= (in_.size() - pos_) / 8, "truncated metadata from the scan");
    std::vector<int64_t> v(n);
    for (int64_t& x : v) x = I64();
    return v;
  }
  template <typename Enum>
  Enum Small(uint64_t count) {
    const uint64_t v = U64();
    UCP_CHECK(v < count, "bad metadata from the scan");
    return static_cast<Enum>(v);
  }
  bool done() const { return pos_ == in_.size(); }

 private:
  std::string_view in_;
  size_t pos_ = 0;
};

void Encode(const ScanResult& r, Encoder& e) {
  e.I64(r.root.version);
  e.I64(r.root.iteration);
  e.I64(r.root.consumed_samples);
  for (const std::string* s :
       {&r.root.source, &r.root.model, &r.root.layout, &r.root.optimizer,
        &r.root.scheduler, &r.root.args, &r.root.training}) {
    e.Str(*s);
  }
  e.U64(r.root.extra_strings.size());
  for (const auto& [k, v] : r.root.extra_strings) {
    e.Str(k);
    e.Str(v);
  }
  e.U64(r.root.extra_ints.size());
  for (const auto& [k, v] : r.root.extra_ints) {
    e.Str(k);
    e.I64(v);
  }
  e.U64(r.params.size());
  for (const StoredParam& sp : r.params) {
    const ParamInfo& p = sp.info;
    e.Str(p.fqn);
    e.Ints(p.shape);
    e.U64(static_cast<uint64_t>(p.dtype));
    e.Str(p.rule);
    e.U64(static_cast<uint64_t>(p.kind));
    e.I64(p.group);
    e.I64(p.order);
    e.U64(p.tied_copies.size());
    for (const std::string& c : p.tied_copies) e.Str(c);
    e.U64(p.frozen ? 1 : 0);
  }
  e.U64(r.datasets.size());
  for (const DatasetInfo& d : r.datasets) {
    e.U64(static_cast<uint64_t>(d.kind));
    e.Str(d.fqn);
    e.Str(d.state_kind);
    e.Str(d.path);
    e.U64(static_cast<uint64_t>(d.dtype));
    e.Ints(d.shape);
    e.U64(d.offset);
    e.U64(d.nbytes);
    e.U64(d.xxh3);
  }
}

ScanResult Decode(Decoder& d) {
  ScanResult r;
  r.root.version = d.I64();
  r.root.iteration = d.I64();
  r.root.consumed_samples = d.I64();
  for (std::string* s :
       {&r.root.source, &r.root.model, &r.root.layout, &r.root.optimizer,
        &r.root.scheduler, &r.root.args, &r.root.training}) {
    *s = d.Str();
  }
  for (uint64_t n = d.U64(); n > 0; --n) {
    std::string k = d.Str();
    r.root.extra_strings[k] = d.Str();
  }
  for (uint64_t n = d.U64(); n > 0; --n) {
    std::string k = d.Str();
    r.root.extra_ints[k] = d.I64();
  }
  for (uint64_t n = d.U64(); n > 0; --n) {
    StoredParam sp;
    ParamInfo& p = sp.info;
    p.fqn = d.Str();
    p.shape = d.Ints();
    p.dtype = d.Small<DType>(kNumDTypes);
    p.rule = d.Str();
    p.kind = d.Small<ParamKind>(2);
    p.group = d.I64();
    p.order = d.I64();
    for (uint64_t c = d.U64(); c > 0; --c) p.tied_copies.push_back(d.Str());
    p.frozen = d.Small<uint8_t>(2) != 0;
    r.params.push_back(std::move(sp));
  }
  for (uint64_t n = d.U64(); n > 0; --n) {
    DatasetInfo info;
    info.kind = d.Small<DatasetKind>(4);
    info.fqn = d.Str();
    info.state_kind = d.Str();
    info.path = d.Str();
    info.dtype = d.Small<DType>(kNumDTypes);
    info.shape = d.Ints();
    info.offset = d.U64();
    info.nbytes = d.U64();
    info.xxh3 = d.U64();
    r.datasets.push_back(std::move(info));
  }
  UCP_CHECK(d.done(), "trailing metadata from the scan");
  return r;
}

// Error classes a child reports (its first byte after the tag).
enum class ErrorClass : uint64_t { kFormat, kIo, kInternal, kOutOfMemory };

// Frames on the socket between parent and child: an 8-byte length, then
// that many bytes. Both return false if the other side is gone (no SIGPIPE:
// MSG_NOSIGNAL).
bool SendFrame(int fd, std::string_view payload) {
  const uint64_t n = payload.size();
  std::string frame(reinterpret_cast<const char*>(&n), 8);
  frame.append(payload);
  std::string_view rest = frame;
  while (!rest.empty()) {
    const ssize_t k = ::send(fd, rest.data(), rest.size(), MSG_NOSIGNAL);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return false;
    rest.remove_prefix(static_cast<size_t>(k));
  }
  return true;
}

bool ReadExactly(int fd, char* out, size_t n) {
  while (n > 0) {
    const ssize_t k = ::read(fd, out, n);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return false;
    out += k;
    n -= static_cast<size_t>(k);
  }
  return true;
}

// Frames are at most this long (a reply of 1 GiB of metadata is not ours).
constexpr uint64_t kMaxFrame = uint64_t{1} << 30;

bool ReceiveFrame(int fd, std::string& payload) {
  uint64_t n = 0;
  if (!ReadExactly(fd, reinterpret_cast<char*>(&n), 8) || n > kMaxFrame)
    return false;
  payload.resize(n);
  return ReadExactly(fd, payload.data(), n);
}

// CPU time the metadata scan may take: corrupt metadata can send HDF5 into
// an endless loop (found by fuzzing). UCP_H5_SCAN_CPU_SECONDS overrides the
// default of 60 s (tests, fuzzing: fractions such as 0.2 are allowed).
struct CpuLimit {
  double seconds = 60;
  std::string text = "60";  // as the user wrote it, for the message
};
CpuLimit ScanCpuLimit() {
  CpuLimit limit;
  if (const char* v = std::getenv("UCP_H5_SCAN_CPU_SECONDS"); v && *v) {
    char* end = nullptr;
    const double s = std::strtod(v, &end);
    if (end != v && *end == '\0' && s > 0 && s < 1e6) {
      limit.seconds = s;
      limit.text = v;
    }
  }
  return limit;
}

// How many scans one child serves before it exits: 1 (a fresh child for
// each file) unless UCP_H5_SCAN_REUSE says more. Reuse is for fuzzing, where
// forking costs most of an input's time; a file HDF5 crashes on still ends
// its child, and the next scan starts a new one.
int ScanReuse() {
  if (const char* v = std::getenv("UCP_H5_SCAN_REUSE"); v && *v) {
    char* end = nullptr;
    const long n = std::strtol(v, &end, 10);
    if (end != v && *end == '\0' && n >= 1 && n <= 1000000000)
      return static_cast<int>(n);
  }
  return 1;
}

// Set by sanitizer runtimes (tests, fuzzing builds); absent otherwise.
extern "C" void __sanitizer_set_death_callback(void (*callback)())
    __attribute__((weak));

using ScanFn = ScanResult (*)(const std::filesystem::path& path,
                              uint64_t file_size);

// Runs the child's side: prepares the process once, then scans what each
// request names until the parent closes the socket or `reuse` scans are
// done. Never returns.
[[noreturn]] void ServeScans(int fd, ScanFn scan, const CpuLimit& cpu_limit,
                             int reuse) {
  // Only the socket stays open: a child living across many scans must not
  // keep the parent's files, pipes or locks open behind its back.
  if (fd != 3) {
    ::dup2(fd, 3);
    fd = 3;
  }
  ::close_range(4, ~0U, 0);
  // A crash in HDF5 ends the child by its signal (the parent reports it):
  // no core file, and no inherited crash handler (a sanitizer's, a
  // fuzzer's) that would report it as the parent's own.
  const struct rlimit no_core = {0, 0};
  ::setrlimit(RLIMIT_CORE, &no_core);
  for (int sig : {SIGSEGV, SIGBUS, SIGABRT, SIGFPE, SIGILL, SIGPROF, SIGXCPU})
    std::signal(sig, SIG_DFL);
  // Under a sanitizer, HDF5's stray copies are caught before they fault
  // and the child exits with an error status; a death callback inherited
  // from a fuzzer would save the input as its own crash.
  if (__sanitizer_set_death_callback != nullptr)
    __sanitizer_set_death_callback(nullptr);
  // What a crashing HDF5 or allocator prints is not ours to show: the
  // parent reports the failure in one line.
  if (const int null = ::open("/dev/null", O_WRONLY | O_CLOEXEC); null >= 0) {
    ::dup2(null, STDERR_FILENO);
    ::close(null);
  }
  // HDF5 keeps freed blocks of up to 16 MiB per kind for the next file
  // (64 KiB by default): the metadata cache of each open file is larger
  // than that, and allocating it afresh cost a fifth of a scan.
  H5set_free_list_limits(64 << 20, 16 << 20, 64 << 20, 16 << 20, 64 << 20,
                         16 << 20);
  const auto usec = static_cast<long long>(cpu_limit.seconds * 1e6);
  std::string request;
  for (int served = 0; served < reuse && ReceiveFrame(fd, request); ++served) {
    // SIGPROF (default action: end the process) after the limit of CPU
    // time of this scan, to the millisecond; RLIMIT_CPU (whole seconds:
    // SIGXCPU) in case the timer's signal is blocked.
    struct rusage used = {};
    ::getrusage(RUSAGE_SELF, &used);
    const auto cpu_seconds =
        static_cast<rlim_t>(used.ru_utime.tv_sec + used.ru_stime.tv_sec + 2 +
                            static_cast<long long>(cpu_limit.seconds));
    struct rlimit cpu = {};
    ::getrlimit(RLIMIT_CPU, &cpu);
    cpu.rlim_cur = std::min(cpu_seconds, cpu.rlim_max);
    ::setrlimit(RLIMIT_CPU, &cpu);
    struct itimerval timer = {};
    timer.it_value.tv_sec = static_cast<time_t>(usec / 1000000);
    timer.it_value.tv_usec = static_cast<suseconds_t>(usec % 1000000);
    ::setitimer(ITIMER_PROF, &timer, nullptr);
    Encoder e;
    try {
      Decoder d(request);
      const std::filesystem::path path = d.Str();
      const uint64_t file_size = d.U64();
      ScanResult r = scan(path, file_size);
      e.U64(0);
      Encode(r, e);
    } catch (const std::exception& ex) {
      e.out().clear();
      e.U64(1);
      const ErrorClass cls =
          dynamic_cast<const FormatError*>(&ex) != nullptr ? ErrorClass::kFormat
          : dynamic_cast<const IoError*>(&ex) != nullptr   ? ErrorClass::kIo
          : dynamic_cast<const std::bad_alloc*>(&ex) != nullptr
              ? ErrorClass::kOutOfMemory
              : ErrorClass::kInternal;
      e.U64(static_cast<uint64_t>(cls));
      e.Str(ex.what());
    }
    const struct itimerval off = {};
    ::setitimer(ITIMER_PROF, &off, nullptr);
    if (!SendFrame(fd, e.out())) break;
  }
  ::_exit(0);  // no atexit handlers, no destructors of the parent's objects
}

// A child process that reads HDF5 metadata for this one (see above). It is
// forked on the first scan and serves up to ScanReuse() scans; one killed by
// HDF5, or past its CPU limit, is reaped and the next scan forks another.
// The CPU limit is read from the environment when the object is made. Not
// thread-safe (one scan at a time).
class ScanChild {
 public:
  ScanChild(ScanFn scan, int reuse)
      : scan_(scan), reuse_(reuse), cpu_limit_(ScanCpuLimit()) {}
  ~ScanChild() { Stop(); }
  ScanChild(const ScanChild&) = delete;
  ScanChild& operator=(const ScanChild&) = delete;

  // Returns what the child found in the file, rethrowing the ucp::Error it
  // threw. Throws FormatError if the child dies (HDF5 crashed on the file)
  // or runs out of its CPU time (HDF5 looping on the file), IoError if no
  // child can be started.
  ScanResult Scan(const std::filesystem::path& path, uint64_t file_size) {
    Encoder request;
    request.Str(path.native());
    request.U64(file_size);
    if (fd_ < 0 || !SendFrame(fd_, request.out())) {
      Stop();  // a child that went away between scans
      Start();
      if (!SendFrame(fd_, request.out())) {
        Stop();
        throw IoError("cannot send a request to the HDF5 metadata reader");
      }
    }
    std::string reply;
    if (!ReceiveFrame(fd_, reply)) {
      const int status = Stop();
      ThrowDeath(status);
    }
    if (++served_ == reuse_) Stop();
    return DecodeReply(reply);
  }

 private:
  void Start() {
    // Initialised here, the library is inherited ready to use instead of
    // being set up again by every child (most of the cost of the fork).
    h5::Check(H5open(), "initialise the HDF5 library");
    int fds[2];
    if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, fds) != 0) {
      throw IoError("cannot create a socket pair: ", std::strerror(errno));
    }
    std::fflush(nullptr);  // nothing buffered is written twice
    const pid_t pid = ::fork();
    if (pid < 0) {
      const int err = errno;
      ::close(fds[0]);
      ::close(fds[1]);
      throw IoError("cannot start a process to read HDF5 metadata: ",
                    std::strerror(err));
    }
    if (pid == 0) {
      ::close(fds[0]);
      ServeScans(fds[1], scan_, cpu_limit_, reuse_);
    }
    ::close(fds[1]);
    pid_ = pid;
    fd_ = fds[0];
    served_ = 0;
  }

  // Closes the socket (a live child then exits) and reaps the child;
  // returns its wait status (0 if there was none).
  int Stop() {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
    int status = 0;
    if (pid_ > 0) {
      while (::waitpid(pid_, &status, 0) < 0 && errno == EINTR) {
      }
    }
    pid_ = -1;
    return status;
  }

  [[noreturn]] void ThrowDeath(int status) const {
    if (WIFSIGNALED(status) &&
        (WTERMSIG(status) == SIGPROF || WTERMSIG(status) == SIGXCPU ||
         WTERMSIG(status) == SIGKILL)) {
      throw FormatError("reading the HDF5 metadata took more than ",
                        cpu_limit_.text,
                        " s of CPU (HDF5 looping on corrupt metadata?); the "
                        "file is corrupt");
    }
    if (WIFSIGNALED(status)) {
      throw FormatError("HDF5 crashed reading the metadata (signal ",
                        WTERMSIG(status), ": ", strsignal(WTERMSIG(status)),
                        "); the file is corrupt");
    }
    const int code = WIFEXITED(status) ? WEXITSTATUS(status) : status;
    if (code == 0) {  // it ended well but its answer did not arrive whole
      throw FormatError("the HDF5 metadata is over ", kMaxFrame >> 30,
                        " GiB or its reading stopped short; the file is "
                        "corrupt");
    }
    throw FormatError("HDF5 failed reading the metadata (exit status ", code,
                      "); the file is corrupt");
  }

  static ScanResult DecodeReply(const std::string& reply) {
    Decoder d(reply);
    if (d.U64() == 0) return Decode(d);
    const auto cls = d.Small<ErrorClass>(4);
    const std::string message = d.Str();
    switch (cls) {
      case ErrorClass::kFormat:
        throw FormatError(message);
      case ErrorClass::kIo:
        throw IoError(message);
      case ErrorClass::kOutOfMemory:
        throw std::bad_alloc();
      case ErrorClass::kInternal:
        break;
    }
    throw InternalError(message);
  }

  ScanFn scan_;
  int reuse_;
  CpuLimit cpu_limit_;
  pid_t pid_ = -1;
  int fd_ = -1;
  int served_ = 0;
};

// Scans `path` in a child process (see ScanChild::Scan for what it throws).
ScanResult ScanInChild(ScanFn scan, const std::filesystem::path& path,
                       uint64_t file_size) {
  const int reuse = ScanReuse();
  if (reuse == 1) return ScanChild(scan, 1).Scan(path, file_size);
  static std::mutex mu;
  static ScanChild shared(scan, reuse);
  const std::lock_guard<std::mutex> lock(mu);
  return shared.Scan(path, file_size);
}

}  // namespace

struct AtomStoreReader::Impl {
  File file;
  uint64_t file_size = 0;
  RootInfo root;
  std::vector<StoredParam> params;
  std::vector<DatasetInfo> datasets;
  std::unordered_map<std::string, size_t> param_index;
  std::unordered_map<std::string, DatasetId> by_path;

  const DatasetInfo* FindPath(const std::string& path) const {
    auto it = by_path.find(path);
    return it == by_path.end() ? nullptr : &datasets[it->second];
  }

  // Reads all metadata with HDF5 (in the calling process).
  static ScanResult Scan(const std::filesystem::path& path,
                         uint64_t file_size) {
    try {
      h5::Silence();
      h5::PropertyList fapl = FileAccessList(FileMode::kRead);
      hid_t id = H5Fopen(path.c_str(), H5F_ACC_RDONLY, fapl.get());
      if (id < 0) {
        throw FormatError("not a readable HDF5 file: ", h5::ErrorStack());
      }
      h5::File h5file(id, "open HDF5 file");
      Scanner scanner(h5file.get(), file_size);
      ScanResult r;
      r.root = scanner.ReadRoot();
      scanner.ScanParams();
      scanner.ScanBuffers();
      scanner.ScanOpaque();
      h5file.Close("close HDF5 file");
      r.params = std::move(scanner.params());
      r.datasets = std::move(scanner.datasets());
      return r;
    } catch (const IoError& e) {
      // HDF5 failing on a file we could open means its metadata is damaged.
      throw FormatError("cannot read HDF5 metadata: ", e.what());
    }
  }

  void Index() {
    std::sort(datasets.begin(), datasets.end(),
              [](const DatasetInfo& a, const DatasetInfo& b) {
                return std::tie(a.offset, a.path) < std::tie(b.offset, b.path);
              });
    std::sort(params.begin(), params.end(),
              [](const StoredParam& a, const StoredParam& b) {
                return std::tie(a.info.order, a.info.fqn) <
                       std::tie(b.info.order, b.info.fqn);
              });
    for (size_t i = 0; i < params.size(); ++i) {
      param_index.emplace(params[i].info.fqn, i);
    }
    for (size_t i = 0; i < datasets.size(); ++i) {
      DatasetInfo& d = datasets[i];
      d.id = static_cast<DatasetId>(i);
      by_path.emplace(d.path, d.id);
      if (d.kind == DatasetKind::kAtom || d.kind == DatasetKind::kPad) {
        StoredParam& p = params[param_index.at(d.fqn)];
        (d.kind == DatasetKind::kAtom ? p.atoms : p.pads).push_back(d.id);
      }
    }
  }
};

AtomStoreReader::AtomStoreReader(std::unique_ptr<Impl> impl) noexcept
    : impl_(std::move(impl)) {}
AtomStoreReader::AtomStoreReader(AtomStoreReader&&) noexcept = default;
AtomStoreReader& AtomStoreReader::operator=(AtomStoreReader&&) noexcept =
    default;
AtomStoreReader::~AtomStoreReader() = default;

AtomStoreReader AtomStoreReader::Open(const std::filesystem::path& path) {
  auto impl = std::make_unique<Impl>();
  try {
    impl->file = File::OpenRead(path);
    impl->file_size = impl->file.Size();
    const uint64_t size = impl->file_size;
    ScanResult r = ScanInChild(&Impl::Scan, path, size);
    impl->root = std::move(r.root);
    impl->params = std::move(r.params);
    impl->datasets = std::move(r.datasets);
    UCP_CHECK(impl->datasets.size() < UINT32_MAX, "too many datasets");
    impl->Index();
  } catch (Error& e) {
    e.AddContext("universal file ", path.string());
    throw;
  }
  return AtomStoreReader(std::move(impl));
}

const std::filesystem::path& AtomStoreReader::path() const noexcept {
  return impl_->file.path();
}

const RootInfo& AtomStoreReader::root() const noexcept { return impl_->root; }

uint64_t AtomStoreReader::file_size() const noexcept {
  return impl_->file_size;
}

std::span<const StoredParam> AtomStoreReader::params() const noexcept {
  return impl_->params;
}

std::span<const DatasetInfo> AtomStoreReader::datasets() const noexcept {
  return impl_->datasets;
}

const DatasetInfo& AtomStoreReader::dataset(DatasetId id) const {
  UCP_CHECK(id < impl_->datasets.size(), "dataset id ", id, " out of range");
  return impl_->datasets[id];
}

const StoredParam* AtomStoreReader::FindParam(std::string_view fqn) const {
  auto it = impl_->param_index.find(std::string(fqn));
  return it == impl_->param_index.end() ? nullptr : &impl_->params[it->second];
}

const DatasetInfo* AtomStoreReader::FindAtom(
    std::string_view fqn, std::string_view state_kind) const {
  if (fqn.empty() || state_kind.empty()) return nullptr;
  return impl_->FindPath(AtomPath(fqn, state_kind));
}

const DatasetInfo* AtomStoreReader::FindPadAtom(
    std::string_view fqn, std::string_view state_kind) const {
  if (fqn.empty() || state_kind.empty()) return nullptr;
  return impl_->FindPath(PadPath(fqn, state_kind));
}

const DatasetInfo* AtomStoreReader::FindBuffer(std::string_view fqn) const {
  if (fqn.empty()) return nullptr;
  return impl_->FindPath(BufferPath(fqn));
}

const DatasetInfo* AtomStoreReader::FindOpaque(std::string_view key) const {
  std::optional<std::string> path = OpaquePath(key);
  return path ? impl_->FindPath(*path) : nullptr;
}

void AtomStoreReader::Read(DatasetId id, uint64_t byte_offset,
                           std::span<std::byte> out) const {
  const DatasetInfo& d = dataset(id);
  UCP_CHECK(byte_offset <= d.nbytes && out.size() <= d.nbytes - byte_offset,
            "read of ", out.size(), " bytes at ", byte_offset,
            " outside dataset ", d.path, " of ", d.nbytes, " bytes");
  if (out.empty()) return;
  impl_->file.ReadExact(out.data(), out.size(), d.offset + byte_offset);
}

uint64_t AtomStoreReader::ComputeHash(DatasetId id) const {
  const DatasetInfo& d = dataset(id);
  constexpr uint64_t kChunk = 8 << 20;
  AlignedBuffer buf(std::min(kChunk, std::max<uint64_t>(d.nbytes, 1)));
  Xxh3Hasher hasher;
  for (uint64_t done = 0; done < d.nbytes;) {
    size_t n =
        static_cast<size_t>(std::min<uint64_t>(buf.size(), d.nbytes - done));
    impl_->file.ReadExact(buf.data(), n, d.offset + done);
    hasher.Update(buf.data(), n);
    done += n;
  }
  return hasher.Digest();
}

std::vector<HashMismatch> AtomStoreReader::Verify(
    const std::function<void(uint64_t)>& progress) const {
  std::vector<HashMismatch> mismatches;
  for (const DatasetInfo& d : impl_->datasets) {
    uint64_t actual = ComputeHash(d.id);
    if (actual != d.xxh3) {
      mismatches.push_back(HashMismatch{d.id, d.path, d.xxh3, actual});
    }
    if (progress && d.nbytes > 0) progress(d.nbytes);
  }
  return mismatches;
}

}  // namespace ucp::atoms
