#pragma once
// The base of the three Megatron drivers (legacy, torch_dist, Megatron-FSDP),
// as tensorstore's kvs_backed_chunk_driver is of its drivers: each reads a
// save folder of iter_N/ folders (megatron_format.h) that the option
// `iteration` picks from, the tracker's by default. The base declares that
// option, lists a save folder's iterations and checks the options before a
// checkpoint is opened; a driver says which iteration folders are its own
// format's (HoldsIteration) and opens one (OpenIteration).

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string_view>
#include <vector>

#include "engine/formats/driver.h"

namespace ucp::megatron {

/// The source option naming the iteration to read (`--iteration N`).
inline constexpr const char* kIterationOption = "iteration";

class IterationDriver : public formats::Driver {
 public:
  /// The iteration option ("<HelpPrefix()>: the iteration to read (default:
  /// the tracker's)"), then MoreSourceOptionSpecs().
  std::vector<formats::OptionSpec> SourceOptionSpecs() const final;
  /// The iter_N folders of `dir` that HoldsIteration accepts, each selected
  /// by its iteration (complete or not: Open says what is wrong). Never
  /// throws.
  std::vector<formats::SavedCheckpoint> ListCheckpoints(
      const std::filesystem::path& dir) const final;
  /// Checks `options` (formats::CheckOptions), then OpenIteration with the
  /// iteration option's value. Throws UsageError for an option the driver
  /// does not take, else what OpenIteration throws.
  std::unique_ptr<formats::Source> Open(
      const std::filesystem::path& path,
      const formats::SourceOptions& options) const final;
  /// Megatron's tracker (latest_checkpointed_iteration.txt): the iteration,
  /// or "release" for a release/ folder, written atomically. Throws IoError.
  void WriteTracker(const std::filesystem::path& dir,
                    const formats::CheckpointInfo& checkpoint) const override;

 protected:
  /// How the option's help names the format ("torch_dist").
  virtual std::string_view HelpPrefix() const = 0;
  /// The driver's source options besides the iteration; none by default.
  virtual std::vector<formats::OptionSpec> MoreSourceOptionSpecs() const {
    return {};
  }
  /// Whether iteration folder `iter_dir` holds this format's files (never
  /// throws).
  virtual bool HoldsIteration(const std::filesystem::path& iter_dir) const = 0;
  /// Discovers the checkpoint at `path` (a save folder or an iteration
  /// folder; `iteration` when given). Throws as Driver::Open.
  virtual std::unique_ptr<formats::Source> OpenIteration(
      const std::filesystem::path& path, std::optional<int64_t> iteration,
      const formats::SourceOptions& options) const = 0;
};

/// A Megatron format ucp writes (the legacy files, torch_dist): a tracker,
/// placement by the layout, every parallel size as a target axis.
class WritableIterationDriver : public IterationDriver {
 public:
  bool HasTracker() const override { return true; }
  bool CanWrite() const override { return true; }
  bool PlacesByLayout() const override { return true; }
  formats::TopologyAxes TargetAxes() const override {
    return {.tp = true,
            .pp = true,
            .vpp = true,
            .dp = true,
            .ep = true,
            .etp = true};
  }
};

}  // namespace ucp::megatron
