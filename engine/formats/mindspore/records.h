#pragma once
// What the reader of a MindSpore checkpoint (reader.cc, PlanSource) takes
// each record of its files for, as data: a pure step of reading, before any
// tensor byte is read.
//   A record named by a kMomentPrefixes prefix plus the tag of another
//   record is that record's Adam moment (exp_avg / exp_avg_sq).
//   nn.Adam's and MindFormers' scalars (global_step, learning_rate,
//   beta1_power, ..., kOptimizerScalars) and records of a type ucp does not
//   read (DTypeOfTensorType) are kept verbatim, as are map tensors.
//   Every other record is a param: trainable when the checkpoint has no
//   moments or it has a moment; a buffer when it is not trainable or not
//   floating point; float32 weights of a trainable param are its `fp32`
//   atom, any other its `param` atom.

#include <cstddef>
#include <map>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "engine/core/dtype.h"
#include "engine/formats/mindspore/ckpt.h"

namespace ucp::mindspore {

/// The records of a checkpoint's files (every rank's, rank order).
struct RecordIndex {
  struct Held {
    size_t rank;
    const CkptEntry* entry;
  };
  /// Each tag's first record, in order of first appearance.
  std::vector<const CkptEntry*> entries;
  /// Each tag's records with the rank (file index) holding each.
  std::map<std::string, std::vector<Held>> held;
  /// The params that have a moment.
  std::set<std::string> with_moments;

  /// The param and state kind of a moment record's tag; absent for others.
  std::optional<std::pair<std::string, std::string>> Moment(
      const std::string& tag) const;
  /// Whether the checkpoint holds Adam's moments.
  bool has_optimizer() const noexcept { return !with_moments.empty(); }
};

/// The index of `files`' records. Never throws.
RecordIndex IndexRecords(std::span<const CkptIndex* const> files);

/// What one record (a RecordIndex entry) is taken for.
struct RecordRole {
  enum Kind { kParam, kMoment, kOther } kind = kOther;
  /// A param's own tag, a moment's param; empty for others.
  std::string param;
  /// "fp32" | "param" for a param; "exp_avg" | "exp_avg_sq" for a moment.
  std::string state_kind;
  /// Its dtype; absent for a type ucp does not read.
  std::optional<DType> dtype;
  bool buffer = false;    // a param that is not trained
  bool verbatim = false;  // kept as it is (others, map tensors)
};

/// The role of each of `index.entries`, in its order. Never throws.
std::vector<RecordRole> ClassifyRecords(const RecordIndex& index);

}  // namespace ucp::mindspore
