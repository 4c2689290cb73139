#include "engine/atoms/schema.h"

#include <hdf5.h>

#include "engine/atoms/atom_store.h"
#include "engine/atoms/names.h"
#include "engine/core/error.h"

namespace ucp::atoms {

std::string_view ParamKindName(ParamKind kind) noexcept {
  return kind == ParamKind::kBuffer ? "buffer" : "param";
}

namespace internal {

bool IsFixedRootAttr(std::string_view name) noexcept {
  for (const char* fixed :
       {kAttrFormat, kAttrVersion, kAttrIteration, kAttrConsumedSamples,
        kAttrSource, kAttrModel, kAttrLayout, kAttrOptimizer, kAttrScheduler,
        kAttrArgs, kAttrTraining}) {
    if (name == fixed) return true;
  }
  return false;
}

namespace {

h5::Datatype CopyType(hid_t type) {
  return h5::Datatype(H5Tcopy(type), "copy datatype");
}

h5::Datatype ComplexType(hid_t part) {
  size_t part_size = H5Tget_size(part);
  h5::Datatype t(H5Tcreate(H5T_COMPOUND, 2 * part_size), "create complex type");
  h5::Check(H5Tinsert(t.get(), "r", 0, part), "insert complex real part");
  h5::Check(H5Tinsert(t.get(), "i", part_size, part),
            "insert complex imaginary part");
  return t;
}

}  // namespace

h5::Datatype StorageType(DType dtype) {
  switch (dtype) {
    case DType::kFloat64:
      return CopyType(H5T_IEEE_F64LE);
    case DType::kFloat32:
      return CopyType(H5T_IEEE_F32LE);
    case DType::kInt64:
      return CopyType(H5T_STD_I64LE);
    case DType::kInt32:
      return CopyType(H5T_STD_I32LE);
    case DType::kInt16:
      return CopyType(H5T_STD_I16LE);
    case DType::kInt8:
      return CopyType(H5T_STD_I8LE);
    case DType::kUInt64:
      return CopyType(H5T_STD_U64LE);
    case DType::kUInt32:
      return CopyType(H5T_STD_U32LE);
    case DType::kFloat16:
    case DType::kBFloat16:
    case DType::kUInt16:
      return CopyType(H5T_STD_U16LE);
    case DType::kUInt8:
    case DType::kBool:
    case DType::kFloat8E4M3Fn:
    case DType::kFloat8E5M2:
    case DType::kFloat8E4M3Fnuz:
    case DType::kFloat8E5M2Fnuz:
      return CopyType(H5T_STD_U8LE);
    case DType::kComplex64:
      return ComplexType(H5T_IEEE_F32LE);
    case DType::kComplex128:
      return ComplexType(H5T_IEEE_F64LE);
  }
  UCP_CHECK(false, "unhandled dtype ", static_cast<int>(dtype));
  return {};
}

std::string DescribeType(h5::Hid type) {
  const char* cls = "unknown";
  switch (H5Tget_class(type)) {
    case H5T_INTEGER:
      cls = H5Tget_sign(type) == H5T_SGN_NONE ? "unsigned integer" : "integer";
      break;
    case H5T_FLOAT:
      cls = "float";
      break;
    case H5T_STRING:
      cls = "string";
      break;
    case H5T_COMPOUND:
      cls = "compound";
      break;
    case H5T_ENUM:
      cls = "enum";
      break;
    case H5T_BITFIELD:
      cls = "bitfield";
      break;
    case H5T_OPAQUE:
      cls = "opaque";
      break;
    case H5T_ARRAY:
      cls = "array";
      break;
    case H5T_VLEN:
      cls = "vlen";
      break;
    case H5T_REFERENCE:
      cls = "reference";
      break;
    default:
      break;
  }
  const char* order = "";
  if (H5Tget_order(type) == H5T_ORDER_BE) order = " big-endian";
  return StrCat(cls, order, " of ", H5Tget_size(type), " bytes");
}

std::string ParamPath(std::string_view fqn) {
  return StrCat(kParamsGroup, "/", EscapeLinkName(fqn));
}

std::string AtomPath(std::string_view fqn, std::string_view state_kind) {
  return StrCat(ParamPath(fqn), "/", EscapeLinkName(state_kind, kPadGroup));
}

std::string PadPath(std::string_view fqn, std::string_view state_kind) {
  return StrCat(ParamPath(fqn), "/", kPadGroup, "/",
                EscapeLinkName(state_kind));
}

std::string BufferPath(std::string_view fqn) {
  return StrCat(kBuffersGroup, "/", EscapeLinkName(fqn));
}

std::optional<std::string> OpaquePath(std::string_view key) {
  std::string path = kOpaqueGroup;
  size_t start = 0;
  while (true) {
    size_t slash = key.find('/', start);
    std::string_view part = key.substr(start, slash == std::string_view::npos
                                                  ? std::string_view::npos
                                                  : slash - start);
    if (part.empty()) return std::nullopt;
    path += '/';
    path += EscapeLinkName(part);
    if (slash == std::string_view::npos) break;
    start = slash + 1;
  }
  return path;
}

h5::PropertyList FileAccessList(FileMode mode) {
  h5::PropertyList fapl(H5Pcreate(H5P_FILE_ACCESS), "create file access list");
  h5::Check(H5Pset_alignment(fapl.get(), kAlignmentThreshold, kAlignment),
            "set alignment");
  h5::Check(H5Pset_libver_bounds(fapl.get(), H5F_LIBVER_V18, H5F_LIBVER_V18),
            "set format bounds");
  // Lock while HDF5 has the file open, but do not fail on filesystems that
  // have no flock; $HDF5_USE_FILE_LOCKING=FALSE overrides this.
  h5::Check(H5Pset_file_locking(fapl.get(), true, true), "set file locking");
  // H5Fclose fails instead of leaving the file open if an object is still
  // open: raw I/O must not overlap an open HDF5 handle.
  h5::Check(H5Pset_fclose_degree(fapl.get(), H5F_CLOSE_SEMI),
            "set close degree");
  if (mode == FileMode::kRead) {
    // Drop each object's metadata from the cache when it is closed: a scan
    // touches every object header once, and a cache filled with tens of
    // thousands of them costs more to maintain and tear down than to skip.
    // (For writing this is 10x slower.)
    h5::Check(H5Pset_evict_on_close(fapl.get(), true), "set evict on close");
  }
  return fapl;
}

h5::PropertyList LinkCreationList() {
  h5::PropertyList lcpl(H5Pcreate(H5P_LINK_CREATE), "create link list");
  h5::Check(H5Pset_char_encoding(lcpl.get(), H5T_CSET_UTF8),
            "set link name encoding");
  return lcpl;
}

}  // namespace internal
}  // namespace ucp::atoms
