#pragma once
// Internal pieces of the universal-file schema shared by the writer and the
// reader (the schema itself is documented in atom_store.h).

#include <optional>
#include <string>
#include <string_view>

#include "engine/atoms/h5/h5.h"
#include "engine/core/dtype.h"

namespace ucp::atoms::internal {

// Attribute and group names.
inline constexpr char kAttrFormat[] = "ucp_format";
inline constexpr char kAttrVersion[] = "ucp_version";
inline constexpr char kAttrIteration[] = "iteration";
inline constexpr char kAttrConsumedSamples[] = "consumed_samples";
inline constexpr char kAttrSource[] = "source";
inline constexpr char kAttrModel[] = "model";
inline constexpr char kAttrLayout[] = "layout";
inline constexpr char kAttrOptimizer[] = "optimizer";
inline constexpr char kAttrScheduler[] = "scheduler";
inline constexpr char kAttrArgs[] = "args";
inline constexpr char kAttrTraining[] = "training";

inline constexpr char kAttrShape[] = "shape";
inline constexpr char kAttrDType[] = "dtype";
inline constexpr char kAttrRule[] = "rule";
inline constexpr char kAttrKind[] = "kind";
inline constexpr char kAttrGroup[] = "group";
inline constexpr char kAttrOrder[] = "order";
inline constexpr char kAttrTiedCopies[] = "tied_copies";
inline constexpr char kAttrFrozen[] = "frozen";
inline constexpr char kAttrXxh3[] = "xxh3";

inline constexpr char kParamsGroup[] = "/params";
inline constexpr char kBuffersGroup[] = "/buffers";
inline constexpr char kOpaqueGroup[] = "/opaque";
inline constexpr char kPadGroup[] = "pad";

/// True for the root attribute names RootInfo has fields for.
bool IsFixedRootAttr(std::string_view name) noexcept;

/// The HDF5 file type a dtype is stored as (a fresh copy). Throws IoError.
h5::Datatype StorageType(DType dtype);

/// "float (4 bytes)"-style description of an HDF5 datatype for messages.
std::string DescribeType(h5::Hid type);

/// HDF5 paths of the datasets (escaped, see names.h).
std::string ParamPath(std::string_view fqn);
std::string AtomPath(std::string_view fqn, std::string_view state_kind);
std::string PadPath(std::string_view fqn, std::string_view state_kind);
std::string BufferPath(std::string_view fqn);
/// Absent if the key has an empty "/"-separated part.
std::optional<std::string> OpaquePath(std::string_view key);

enum class FileMode { kRead, kWrite };
/// File access list: alignment, libver bounds, file locking that tolerates
/// filesystems without locks, strict close; for kRead eviction of closed
/// objects from the metadata cache. Throws IoError.
h5::PropertyList FileAccessList(FileMode mode);
/// Link creation list with the UTF-8 charset. Throws IoError.
h5::PropertyList LinkCreationList();

}  // namespace ucp::atoms::internal
