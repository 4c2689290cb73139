#pragma once
// `ucp diff` as a library call: two checkpoints of any readable formats and
// layouts (or universal files) compared through their universal content,
// param by param and state kind by state kind (fp32, param, exp_avg,
// exp_avg_sq, step, ...).
//
// Found: params and states only one side has, shape and dtype differences,
// and for the values of a state both sides hold in one shape the number of
// differing elements, the largest absolute and relative difference and the
// first differing element (compare.h has the rules: bitwise by default,
// numpy.isclose with a tolerance; differing dtypes are compared as values).
// Pad atoms (vocabulary padding rows beyond the true vocabulary), opaque
// objects and the model's attributes are not compared.
//
// Streaming: each state is read in windows of consecutive elements (boxes of
// the param), A's windows of a batch (8 MiB: it stays in the cache) into a
// buffer, then B's, each of B's chunks compared with A's elements on the
// executor's threads as it arrives (a chunk stored as it is in a file is
// read and compared 256 KiB at a time); every byte of both sides is read
// once, and memory stays within the budget.

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "engine/core/dtype.h"
#include "engine/core/strided.h"
#include "engine/diff/compare.h"
#include "engine/formats/driver.h"
#include "engine/reshape/executor.h"
#include "engine/universal/input.h"
#include "layouts/variables.h"

namespace ucp::json {
class Value;
}

namespace ucp::diff {

/// One state kind of a param.
struct StateDiff {
  std::string state;  // "fp32", "exp_avg", ...
  bool in_a = false, in_b = false;
  DType a_dtype = DType::kFloat32, b_dtype = DType::kFloat32;  // when in it
  Shape a_shape, b_shape;                                      // when in it
  /// Values compared: in both, same shape, ValuesComparable dtypes.
  bool values_compared = false;
  ElementStats values;
  /// The first differing element's index per dim (values.first unravelled);
  /// empty when none.
  Shape first_index;
  /// In one side only, but what the other side holds implies it (Compare's
  /// derived states): not a difference. `note` says why, or (derived false)
  /// why such a state differs.
  bool derived = false;
  std::string note;

  bool shape_differs() const { return in_a && in_b && a_shape != b_shape; }
  bool dtype_differs() const { return in_a && in_b && a_dtype != b_dtype; }
  /// In both, same shape and dtype, no differing element; or derived.
  bool equal() const {
    if (derived) return true;
    return in_a && in_b && !shape_differs() && !dtype_differs() &&
           values_compared && values.differing == 0;
  }
};

/// A param of either side: its states in A's order, then B's others.
struct ParamDiff {
  std::string name;
  bool in_a = false, in_b = false;
  std::vector<StateDiff> states;  // empty unless in both
  bool equal() const;
};

struct Report {
  std::string a, b;                // the paths as given
  std::string a_format, b_format;  // "universal" or the driver's name
  Tolerance tolerance;
  /// Every param of either side: A's in its order, then B's others.
  std::vector<ParamDiff> params;
  int64_t params_compared = 0;    // in both
  int64_t states_compared = 0;    // values compared
  int64_t elements_compared = 0;  // summed over states
  int64_t differing_elements = 0;
  int64_t derived_states = 0;  // in one side only, derived (not compared)
  uint64_t bytes_read = 0;     // by the comparison's reads (both sides)
  bool equal() const;
};

struct Options {
  Tolerance tolerance;
  /// A name map (formats/name_map.h): each side whose names it knows is
  /// viewed under its names ("" none).
  std::string names;
  layouts::Variables model_vars;  // for the name map (--model-var)
  /// How each side is read (the driver's options; a layout).
  formats::SourceOptions source;
  reshape::ExecutorOptions executor;  // threads, --memory
  bool progress = false;              // a progress bar (Progress::kAuto)
  /// A's bytes read per batch before B's are compared with them (0: 8 MiB,
  /// at most half the memory budget; for benchmarks).
  uint64_t batch_bytes = 0;
};

/// Compares two universal contents. A state in one side only is derived,
/// not a difference, when the other side implies it, as ucp's writers derive
/// it for a format that keeps it: the training-dtype copy (`param`) of a
/// param whose fp32 master both sides hold (the masters are compared), and a
/// per-param `step` whose values all equal the other side's optimizer step
/// (its optimizer record's step, else its training step, else its
/// iteration). Throws what their Run() throws (IoError,
/// FormatError naming the file), UsageError for a negative tolerance.
Report Compare(const universal::UniversalInput& a,
               const universal::UniversalInput& b, const Options& options);

/// A checkpoint or universal file opened for comparison (and kept open).
class Opened {
 public:
  /// A universal file (HDF5), else a checkpoint of the format the registry
  /// detects, its plan verified (coverage, replicas), viewed under
  /// `options.names` when that map knows its names. Throws IoError for a
  /// missing path, FormatError / LayoutError as the driver does.
  static Opened Open(const std::filesystem::path& path, const Options& options);
  Opened(Opened&&) noexcept;
  Opened& operator=(Opened&&) noexcept;
  ~Opened();
  const universal::UniversalInput& input() const;
  /// "universal" or the driver's name.
  const std::string& format() const;
  /// True when viewed under the names of Options::names.
  bool mapped() const;

 private:
  Opened();
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

/// Opens both (Opened::Open) and compares them; Report::a / b name the paths.
/// With options.names, a map that knows neither side's names is a
/// UsageError.
Report DiffPaths(const std::filesystem::path& a, const std::filesystem::path& b,
                 const Options& options);

/// The report as a JSON document: {"equal", "a", "b", "tolerance",
/// "summary": {...}, "params": [{"name", "status", "states": [...]}]},
/// equal params included (status "equal").
json::Value ToJson(const Report& report);

/// One line per difference ("param P: only in A", "param P > exp_avg: 3 of
/// 4096 elements differ, first [0, 7], max abs 0.5, max rel 1"), in report
/// order.
std::vector<std::string> DifferenceLines(const Report& report);

}  // namespace ucp::diff
