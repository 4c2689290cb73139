#pragma once
// A thin RAII layer over the HDF5 C API, private to engine/atoms.
//
// hdf5.h is included only by .cc files; here an HDF5 id is an int64_t (hid_t
// is int64_t in HDF5 >= 1.10, checked by a static_assert in h5.cc). Every
// HDF5 failure becomes a ucp::IoError whose message is `what` followed by the
// descriptions on HDF5's error stack ("open file x.h5: unable to open file:
// file signature not found"). Call Silence() on each thread before using HDF5
// (the thread-safe library keeps one error stack per thread).
//
// Callers keep every HDF5 call on one thread at a time; the thread-safe build
// serialises the library behind one global lock anyway.

#include <compare>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace ucp::atoms::h5 {

using Hid = int64_t;

/// What an id names; selects its close function (H5Fclose, H5Gclose, ...).
enum class Kind {
  kFile,
  kGroup,
  kDataset,
  kObject,  // from H5Oopen: any of group / dataset / named datatype
  kDataspace,
  kDatatype,
  kAttribute,
  kPropertyList,
};

/// Turns off HDF5's automatic error printing for the calling thread.
void Silence() noexcept;

/// The descriptions on the calling thread's HDF5 error stack, outermost
/// first, joined by ": " (empty if the stack is empty).
std::string ErrorStack();

/// Throws IoError("<what>[ <subject>]: <HDF5 error stack>"). `what` and
/// `subject` are separate so that callers build no string on success.
[[noreturn]] void Fail(std::string_view what, std::string_view subject = {});

/// Throws IoError (see Fail) if `status` < 0 (herr_t, htri_t, hid_t ...).
inline int64_t Check(int64_t status, std::string_view what,
                     std::string_view subject = {}) {
  if (status < 0) Fail(what, subject);
  return status;
}

/// Calls the close function of `kind`; returns its herr_t.
int CloseId(Kind kind, Hid id) noexcept;

/// Owns one HDF5 id of kind K; move-only; the destructor closes it (errors
/// ignored; call Close() where a failed close matters, e.g. files).
template <Kind K>
class Handle {
 public:
  Handle() noexcept = default;
  /// Takes ownership of `id`. Throws IoError naming `what` and `subject`
  /// (see Fail) if id < 0.
  Handle(Hid id, std::string_view what, std::string_view subject = {})
      : id_(id) {
    Check(id, what, subject);
  }
  Handle(Handle&& other) noexcept : id_(other.id_) { other.id_ = -1; }
  Handle& operator=(Handle&& other) noexcept {
    if (this != &other) {
      Reset();
      id_ = other.id_;
      other.id_ = -1;
    }
    return *this;
  }
  Handle(const Handle&) = delete;
  Handle& operator=(const Handle&) = delete;
  ~Handle() { Reset(); }

  Hid get() const noexcept { return id_; }
  bool valid() const noexcept { return id_ >= 0; }

  /// Closes now. Throws IoError naming `what` and `subject` if HDF5 reports
  /// a failure.
  void Close(std::string_view what, std::string_view subject = {}) {
    Hid id = id_;
    id_ = -1;
    if (id >= 0) Check(CloseId(K, id), what, subject);
  }

 private:
  void Reset() noexcept {
    if (id_ >= 0) CloseId(K, id_);
    id_ = -1;
  }
  Hid id_ = -1;
};

using File = Handle<Kind::kFile>;
using Group = Handle<Kind::kGroup>;
using Dataset = Handle<Kind::kDataset>;
using Object = Handle<Kind::kObject>;
using Dataspace = Handle<Kind::kDataspace>;
using Datatype = Handle<Kind::kDatatype>;
using Attribute = Handle<Kind::kAttribute>;
using PropertyList = Handle<Kind::kPropertyList>;

// ---- Attributes. Writers throw IoError.

/// Scalar variable-length UTF-8 string attribute.
void WriteStringAttr(Hid obj, const char* name, std::string_view value);
/// Scalar 64-bit integer attributes (H5T_STD_I64LE / H5T_STD_U64LE).
void WriteInt64Attr(Hid obj, const char* name, int64_t value);
void WriteUInt64Attr(Hid obj, const char* name, uint64_t value);
/// 1-D H5T_STD_I64LE attribute (an empty span gives a 0-element dataspace).
void WriteInt64ArrayAttr(Hid obj, const char* name,
                         std::span<const int64_t> values);
/// Overwrites the value of an existing scalar integer attribute in place.
void OverwriteUInt64Attr(Hid obj, const char* name, uint64_t value);

/// Reads attributes, keeping the memory types it needs. Each reader
/// returns nullopt if the attribute is absent, throws FormatError if it has
/// an unexpected type or shape and IoError if HDF5 fails.
class AttrReader {
 public:
  /// Throws IoError.
  AttrReader();

  /// A scalar string attribute (variable- or fixed-length, ASCII or UTF-8;
  /// a fixed-length one loses its trailing NULs).
  std::optional<std::string> String(Hid obj, const char* name);
  /// A scalar (or 1-element) integer attribute, converted.
  std::optional<int64_t> Int64(Hid obj, const char* name);
  std::optional<uint64_t> UInt64(Hid obj, const char* name);
  /// A 1-D (or scalar, read as one element) integer attribute of at most
  /// kMaxArrayElements elements (FormatError beyond).
  static constexpr int64_t kMaxArrayElements = 1 << 16;
  std::optional<std::vector<int64_t>> Int64Array(Hid obj, const char* name);

  enum class Class { kString, kInteger, kOther };
  /// The class of a scalar attribute that exists (kOther for arrays).
  Class ScalarClass(Hid obj, const char* name);

 private:
  Datatype vlen_utf8_;
  Datatype vlen_ascii_;
};

/// Names of every attribute of `obj`, in HDF5's native order.
std::vector<std::string> AttrNames(Hid obj);

// ---- Links.

/// Names of the links in group `group`, in HDF5's native order. Throws
/// IoError, or FormatError if one is a soft or external link.
std::vector<std::string> LinkNames(Hid group);
/// True if `group` has a link `name` (one path component). Throws IoError.
bool HasLink(Hid group, const char* name);

/// Identifies the object behind an open id (file number and header
/// address), equal for every hard link to it. Throws IoError.
struct ObjectIdentity {
  unsigned long fileno = 0;
  uint64_t address = 0;
  friend auto operator<=>(const ObjectIdentity&,
                          const ObjectIdentity&) = default;
};
ObjectIdentity IdentityOf(Hid obj);

}  // namespace ucp::atoms::h5
