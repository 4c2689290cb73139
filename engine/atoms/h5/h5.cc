#include "engine/atoms/h5/h5.h"

#include <hdf5.h>

#include <cstdlib>
#include <cstring>
#include <type_traits>

#include "engine/core/error.h"

namespace ucp::atoms::h5 {

static_assert(std::is_same_v<hid_t, Hid>, "hid_t must be int64_t (HDF5 1.10+)");

void Silence() noexcept { H5Eset_auto2(H5E_DEFAULT, nullptr, nullptr); }

namespace {

herr_t CollectError(unsigned /*n*/, const H5E_error2_t* err,
                    void* data) noexcept {
  try {
    auto* out = static_cast<std::vector<std::string>*>(data);
    std::string desc = err->desc != nullptr ? err->desc : "";
    if (desc.empty() && err->func_name != nullptr) desc = err->func_name;
    if (!desc.empty() && (out->empty() || out->back() != desc)) {
      out->push_back(std::move(desc));
    }
  } catch (...) {
    return -1;
  }
  return 0;
}

}  // namespace

std::string ErrorStack() {
  std::vector<std::string> descs;
  H5Ewalk2(H5E_DEFAULT, H5E_WALK_DOWNWARD, CollectError, &descs);
  H5Eclear2(H5E_DEFAULT);
  std::string out;
  for (const std::string& d : descs) {
    if (!out.empty()) out += ": ";
    out += d;
  }
  return out;
}

void Fail(std::string_view what, std::string_view subject) {
  std::string stack = ErrorStack();
  if (stack.empty()) stack = "HDF5 call failed";
  if (subject.empty()) throw IoError(what, ": ", stack);
  throw IoError(what, " ", subject, ": ", stack);
}

int CloseId(Kind kind, Hid id) noexcept {
  switch (kind) {
    case Kind::kFile:
      return H5Fclose(id);
    case Kind::kGroup:
      return H5Gclose(id);
    case Kind::kDataset:
      return H5Dclose(id);
    case Kind::kObject:
      return H5Oclose(id);
    case Kind::kDataspace:
      return H5Sclose(id);
    case Kind::kDatatype:
      return H5Tclose(id);
    case Kind::kAttribute:
      return H5Aclose(id);
    case Kind::kPropertyList:
      return H5Pclose(id);
  }
  return -1;
}

namespace {

constexpr std::string_view kCreateAttr = "create attribute";
constexpr std::string_view kWriteAttr = "write attribute";
constexpr std::string_view kReadAttr = "read attribute";
constexpr std::string_view kOpenAttr = "open attribute";
constexpr std::string_view kInspectAttr = "inspect attribute";

Datatype VlenStringType(H5T_cset_t cset) {
  Datatype t(H5Tcopy(H5T_C_S1), "copy string type");
  Check(H5Tset_size(t.get(), H5T_VARIABLE), "set string size");
  Check(H5Tset_cset(t.get(), cset), "set string charset");
  return t;
}

void WriteScalar(Hid obj, const char* name, hid_t file_type, hid_t mem_type,
                 const void* value) {
  Dataspace space(H5Screate(H5S_SCALAR), "create scalar dataspace");
  Attribute attr(
      H5Acreate2(obj, name, file_type, space.get(), H5P_DEFAULT, H5P_DEFAULT),
      kCreateAttr, name);
  Check(H5Awrite(attr.get(), mem_type, value), kWriteAttr, name);
  attr.Close(kWriteAttr, name);
}

// Opens attribute `name` if it exists (one HDF5 call when it does).
std::optional<Attribute> OpenAttr(Hid obj, const char* name) {
  hid_t id = H5Aopen(obj, name, H5P_DEFAULT);
  if (id >= 0) return Attribute(id, kOpenAttr, name);
  std::string stack = ErrorStack();
  htri_t exists = H5Aexists(obj, name);
  Check(exists, kOpenAttr, name);
  if (exists == 0) return std::nullopt;
  throw IoError(kOpenAttr, " ", name, ": ", stack);
}

// Number of elements of the attribute (scalar = 1, null = 0); throws
// FormatError for rank > 1.
hssize_t AttrElements(const Attribute& attr, const char* name) {
  Dataspace space(H5Aget_space(attr.get()), kInspectAttr, name);
  hssize_t n = H5Sget_simple_extent_npoints(space.get());
  Check(n, kInspectAttr, name);
  if (n > 1 && H5Sget_simple_extent_ndims(space.get()) != 1) {
    throw FormatError("attribute ", name, " is not a scalar or a 1-D array");
  }
  return n;
}

template <typename T>
std::optional<T> ReadIntScalar(Hid obj, const char* name, hid_t mem_type) {
  std::optional<Attribute> attr = OpenAttr(obj, name);
  if (!attr) return std::nullopt;
  Datatype type(H5Aget_type(attr->get()), kInspectAttr, name);
  if (H5Tget_class(type.get()) != H5T_INTEGER) {
    throw FormatError("attribute ", name, " is not an integer");
  }
  if (AttrElements(*attr, name) != 1) {
    throw FormatError("attribute ", name, " is not a scalar");
  }
  T value{};
  Check(H5Aread(attr->get(), mem_type, &value), kReadAttr, name);
  return value;
}

}  // namespace

void WriteStringAttr(Hid obj, const char* name, std::string_view value) {
  Datatype type = VlenStringType(H5T_CSET_UTF8);
  std::string copy(value);  // NUL-terminated for HDF5.
  const char* ptr = copy.c_str();
  WriteScalar(obj, name, type.get(), type.get(), &ptr);
}

void WriteInt64Attr(Hid obj, const char* name, int64_t value) {
  WriteScalar(obj, name, H5T_STD_I64LE, H5T_NATIVE_INT64, &value);
}

void WriteUInt64Attr(Hid obj, const char* name, uint64_t value) {
  WriteScalar(obj, name, H5T_STD_U64LE, H5T_NATIVE_UINT64, &value);
}

void WriteInt64ArrayAttr(Hid obj, const char* name,
                         std::span<const int64_t> values) {
  hsize_t dims[1] = {values.size()};
  Dataspace space(H5Screate_simple(1, dims, nullptr), "create dataspace");
  Attribute attr(H5Acreate2(obj, name, H5T_STD_I64LE, space.get(), H5P_DEFAULT,
                            H5P_DEFAULT),
                 kCreateAttr, name);
  if (!values.empty()) {
    Check(H5Awrite(attr.get(), H5T_NATIVE_INT64, values.data()), kWriteAttr,
          name);
  }
  attr.Close(kWriteAttr, name);
}

void OverwriteUInt64Attr(Hid obj, const char* name, uint64_t value) {
  Attribute attr(H5Aopen(obj, name, H5P_DEFAULT), kOpenAttr, name);
  Check(H5Awrite(attr.get(), H5T_NATIVE_UINT64, &value), kWriteAttr, name);
  attr.Close(kWriteAttr, name);
}

AttrReader::AttrReader()
    : vlen_utf8_(VlenStringType(H5T_CSET_UTF8)),
      vlen_ascii_(VlenStringType(H5T_CSET_ASCII)) {}

std::optional<std::string> AttrReader::String(Hid obj, const char* name) {
  std::optional<Attribute> attr = OpenAttr(obj, name);
  if (!attr) return std::nullopt;
  Datatype type(H5Aget_type(attr->get()), kInspectAttr, name);
  if (H5Tget_class(type.get()) != H5T_STRING) {
    throw FormatError("attribute ", name, " is not a string");
  }
  if (AttrElements(*attr, name) != 1) {
    throw FormatError("attribute ", name, " is not a scalar string");
  }
  htri_t is_vlen = H5Tis_variable_str(type.get());
  Check(is_vlen, kInspectAttr, name);
  if (is_vlen > 0) {
    const Datatype& mem =
        H5Tget_cset(type.get()) == H5T_CSET_ASCII ? vlen_ascii_ : vlen_utf8_;
    char* ptr = nullptr;
    Check(H5Aread(attr->get(), mem.get(), &ptr), kReadAttr, name);
    std::string value = ptr != nullptr ? std::string(ptr) : std::string();
    H5free_memory(ptr);
    return value;
  }
  size_t size = H5Tget_size(type.get());
  if (size == 0) Fail(kInspectAttr, name);
  std::string value(size, '\0');
  Check(H5Aread(attr->get(), type.get(), value.data()), kReadAttr, name);
  while (!value.empty() && value.back() == '\0') value.pop_back();
  return value;
}

std::optional<int64_t> AttrReader::Int64(Hid obj, const char* name) {
  return ReadIntScalar<int64_t>(obj, name, H5T_NATIVE_INT64);
}

std::optional<uint64_t> AttrReader::UInt64(Hid obj, const char* name) {
  return ReadIntScalar<uint64_t>(obj, name, H5T_NATIVE_UINT64);
}

std::optional<std::vector<int64_t>> AttrReader::Int64Array(Hid obj,
                                                           const char* name) {
  std::optional<Attribute> attr = OpenAttr(obj, name);
  if (!attr) return std::nullopt;
  Datatype type(H5Aget_type(attr->get()), kInspectAttr, name);
  if (H5Tget_class(type.get()) != H5T_INTEGER) {
    throw FormatError("attribute ", name, " is not an integer array");
  }
  hssize_t n = AttrElements(*attr, name);
  if (n > kMaxArrayElements) {
    throw FormatError("attribute ", name, " has ", n, " elements (at most ",
                      kMaxArrayElements, " expected)");
  }
  std::vector<int64_t> values(static_cast<size_t>(n));
  if (n > 0) {
    Check(H5Aread(attr->get(), H5T_NATIVE_INT64, values.data()), kReadAttr,
          name);
  }
  return values;
}

AttrReader::Class AttrReader::ScalarClass(Hid obj, const char* name) {
  Attribute attr(H5Aopen(obj, name, H5P_DEFAULT), kOpenAttr, name);
  Dataspace space(H5Aget_space(attr.get()), kInspectAttr, name);
  if (H5Sget_simple_extent_type(space.get()) != H5S_SCALAR) {
    return Class::kOther;
  }
  Datatype type(H5Aget_type(attr.get()), kInspectAttr, name);
  switch (H5Tget_class(type.get())) {
    case H5T_STRING:
      return Class::kString;
    case H5T_INTEGER:
      return Class::kInteger;
    default:
      return Class::kOther;
  }
}

namespace {

herr_t CollectAttrName(hid_t /*obj*/, const char* name,
                       const H5A_info_t* /*info*/, void* data) noexcept {
  try {
    static_cast<std::vector<std::string>*>(data)->emplace_back(name);
  } catch (...) {
    return -1;
  }
  return 0;
}

struct LinkList {
  std::vector<std::string> names;
  std::string not_hard;  // first soft / external link seen
};

herr_t CollectLinkName(hid_t /*group*/, const char* name,
                       const H5L_info_t* info, void* data) noexcept {
  try {
    auto* list = static_cast<LinkList*>(data);
    if (info->type != H5L_TYPE_HARD && list->not_hard.empty()) {
      list->not_hard = name;
    }
    list->names.emplace_back(name);
  } catch (...) {
    return -1;
  }
  return 0;
}

}  // namespace

std::vector<std::string> AttrNames(Hid obj) {
  std::vector<std::string> names;
  hsize_t idx = 0;
  Check(H5Aiterate2(obj, H5_INDEX_NAME, H5_ITER_NATIVE, &idx, CollectAttrName,
                    &names),
        "list attributes");
  return names;
}

std::vector<std::string> LinkNames(Hid group) {
  LinkList list;
  hsize_t idx = 0;
  Check(H5Literate(group, H5_INDEX_NAME, H5_ITER_NATIVE, &idx, CollectLinkName,
                   &list),
        "list group members");
  if (!list.not_hard.empty()) {
    throw FormatError("link ", list.not_hard,
                      " is a soft or external link (only hard links allowed)");
  }
  return std::move(list.names);
}

bool HasLink(Hid group, const char* name) {
  return Check(H5Lexists(group, name, H5P_DEFAULT), "look up link", name) > 0;
}

ObjectIdentity IdentityOf(Hid obj) {
  H5O_info_t info;
  Check(H5Oget_info2(obj, &info, H5O_INFO_BASIC), "get object info");
  return ObjectIdentity{info.fileno, static_cast<uint64_t>(info.addr)};
}

}  // namespace ucp::atoms::h5
