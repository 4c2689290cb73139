#pragma once
// Format drivers: the seam every framework plugs into.
//
// A driver knows one framework's files (names, keys, pickled objects, flat
// optimizer buffers) and nothing of other frameworks. It
//   - probes a path cheaply (file names and a few bytes; never throws),
//   - opens (discovers) a checkpoint: tag / iteration, topology, rank files,
//   - plans the checkpoint's fragments (universal::SourcePlan) for
//     to-universal, convert and export,
//   - plans a target checkpoint for a topology from universal content (a
//     universal file or a source plan; universal::UniversalInput) as a
//     TargetPlan that one engine stage writes (emit.h);
//   - declares the options it takes, for reading and for writing
//     (options.h), and which topology sizes a target takes.
// Drivers register themselves (UCP_REGISTER_DRIVER in their .cc); the CLI and
// engine/universal pick them by name and never name a framework. A binary
// that wants every driver links the target ucp::all_formats.

#include <cstdint>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "engine/formats/options.h"
#include "engine/formats/target_plan.h"
#include "engine/json/json.h"
#include "engine/reshape/executor.h"
#include "engine/universal/input.h"
#include "engine/universal/source_plan.h"
#include "layouts/variables.h"

namespace ucp::formats {

/// How sure a driver is that a path is one of its checkpoints.
enum class Confidence : uint8_t { kNo = 0, kMaybe = 1, kYes = 2 };

struct SourceOptions {
  /// A builtin layout name or a YAML file; empty: detected from the names.
  std::string layout;
  /// The tokenizer's true vocabulary size, when the checkpoint lacks it.
  std::optional<int64_t> true_vocab_size;
  /// The driver's own options (Driver::SourceOptionSpecs), e.g. which
  /// checkpoint of a save folder to read.
  OptionValues values;
};

/// What was found on disk, framework-neutral (for messages and --json).
struct CheckpointInfo {
  std::string format;          // driver name
  std::filesystem::path dir;   // the save folder
  std::filesystem::path path;  // the checkpoint folder read
  /// The name the format gives the checkpoint when it is not its iteration
  /// (a DeepSpeed tag); "" otherwise.
  std::string name;
  int64_t iteration = 0;
  layouts::Topology topology;  // tp, pp, vpp, dp as saved
  /// The format's own facts about the saved layout (a ZeRO stage, whether a
  /// distributed optimizer sharded the state), shown in Describe() and
  /// --json, keys with '_' for spaces.
  json::Value settings = json::Value::Object();
  std::string dtype;                         // training dtype, "" if unknown
  std::vector<std::filesystem::path> files;  // every rank file read

  /// "deepspeed checkpoint DIR/global_step2 (global_step2, step 2, tp 1,
  /// pp 1, dp 2, zero stage 2, bf16)".
  std::string Describe() const;
  json::Value ToJson() const;
  /// {"tp", "pp", "vpp", "dp", <settings>}.
  json::Value TopologyJson() const;
};

struct TargetOptions {
  layouts::Topology topology;  // the axes the driver takes; others 1
  bool no_optimizer = false;   // model weights only
  std::optional<int64_t> true_vocab_size;
  /// The driver's own options (Driver::TargetOptionSpecs).
  OptionValues values;
};

/// Which topology sizes a target format takes (--tp, --pp, --vpp, --dp, and
/// for mixture-of-experts models --ep, --etp). A format without any (a
/// universal folder, a consolidated model) takes none of them.
struct TopologyAxes {
  bool tp = false, pp = false, vpp = false, dp = false;
  /// Expert parallelism and expert tensor parallelism (Megatron's
  /// --expert-model-parallel-size, --expert-tensor-parallel-size).
  bool ep = false, etp = false;
  /// --dp must be given (when `dp`); false for a format whose rank layout
  /// may come from elsewhere (MindSpore's strategy files) or be none.
  bool dp_required = true;
  bool any() const { return tp || pp || vpp || dp || ep || etp; }
};

/// An opened (discovered) checkpoint.
class Source {
 public:
  virtual ~Source() = default;
  virtual const CheckpointInfo& info() const noexcept = 0;
  /// Reads every rank file's index and pickle and plans the universal
  /// content. Throws FormatError / LayoutError naming the rank file, param
  /// and problem; IoError if a file cannot be read.
  virtual universal::SourcePlan Plan() const = 0;

  /// Every canonical name once, the model variables and the layout chosen
  /// (for `ucp layout check`). Throws UsageError if the driver has no
  /// layouts, else like Plan.
  struct NameListing {
    std::vector<std::string> names;
    layouts::Variables variables;
    std::string layout_name;
    std::string layout_yaml;
  };
  virtual NameListing ListNames() const;

  /// Whether the checkpoint, as saved, loads in its framework with target
  /// `options` of its own format (`ucp resume` then hands it out unchanged).
  /// False by default.
  virtual bool Fits(const TargetOptions& options) const;

  /// The torch.save archives file `file` (one of info().files) holds, for
  /// integrity checks, manifests and `ucp inspect`; empty: the file itself
  /// is one archive (if it is a zip) or none.
  virtual std::vector<ArchiveSpan> Archives(
      const std::filesystem::path& file) const;

  /// What `ucp inspect` shows of the checkpoint beyond its files' trees (a
  /// checkpoint-level index: keys, global shapes, chunks, files), as
  /// {"text": "...", ...JSON}; null by default. Throws like Plan.
  virtual json::Value Inventory() const;
};

/// One checkpoint of a save folder (`ucp resume`).
struct SavedCheckpoint {
  std::string name;        // its folder: iter_0000100, global_step100
  int64_t iteration = -1;  // from the name; -1 if it carries none
  OptionValues selector;   // Open(save_dir, {.values = selector}) reads it
};

class Driver {
 public:
  virtual ~Driver() = default;
  /// "megatron", "deepspeed", "deepspeed-universal".
  virtual std::string_view Name() const = 0;
  /// One line for `ucp formats` / --help.
  virtual std::string_view Summary() const = 0;

  /// Cheap; never throws (unreadable or foreign input is kNo). A probe
  /// judges its own format's files only: where several formats recognise a
  /// path, the registry decides (Refines, DetectDriver).
  virtual Confidence Probe(const std::filesystem::path& path) const = 0;
  /// The formats whose files this format's checkpoints also are (Megatron's
  /// torch_dist and Megatron-FSDP folders are DCP folders): where this
  /// format and one it refines both recognise a path (Probe) or list a
  /// checkpoint (ListCheckpoints), it is this format's. None by default.
  virtual std::vector<std::string_view> Refines() const { return {}; }
  /// Whether Refines() names format `name`.
  bool RefinesFormat(std::string_view name) const;
  virtual bool CanRead() const { return true; }
  /// The options Open takes (SourceOptions::values).
  virtual std::vector<OptionSpec> SourceOptionSpecs() const { return {}; }
  /// Discovers the checkpoint at `path`. Throws FormatError naming the
  /// missing or malformed file, IoError if unreadable, UsageError for a
  /// selector that names nothing; UsageError if !CanRead().
  virtual std::unique_ptr<Source> Open(const std::filesystem::path& path,
                                       const SourceOptions& options) const;
  /// The checkpoints of save folder `dir` in this format, in any order,
  /// damaged ones included (Open says what is wrong with them). Never
  /// throws; empty by default.
  virtual std::vector<SavedCheckpoint> ListCheckpoints(
      const std::filesystem::path& dir) const;

  /// Whether a save folder of this format names its current checkpoint in a
  /// tracker file (Megatron's latest_checkpointed_iteration.txt, DeepSpeed's
  /// `latest`), so that a framework loads the save folder; without one (a
  /// PyTorch DCP checkpoint) it loads a checkpoint folder itself, which is
  /// what `ucp resume` prints. False by default.
  virtual bool HasTracker() const { return false; }
  /// Writes the save folder `dir`'s tracker (Megatron's
  /// latest_checkpointed_iteration.txt, DeepSpeed's `latest`) naming
  /// `checkpoint`, atomically: what `ucp resume` adds beside the hard links
  /// of a checkpoint that fits but is not the tracked one. Throws IoError;
  /// UsageError if the format has no tracker.
  virtual void WriteTracker(const std::filesystem::path& dir,
                            const CheckpointInfo& checkpoint) const;

  virtual bool CanWrite() const { return false; }
  /// Whether a target places params by a layout descriptor (Megatron's
  /// formats): content that holds none is given one first
  /// (target_layout.h). False by default.
  virtual bool PlacesByLayout() const { return false; }
  /// The topology sizes a target takes; none by default.
  virtual TopologyAxes TargetAxes() const { return {}; }
  /// The options a target takes (TargetOptions::values).
  virtual std::vector<OptionSpec> TargetOptionSpecs() const { return {}; }
  /// Plans the target checkpoint for `options` from universal content (a
  /// universal file or a source plan; universal::UniversalInput) without
  /// writing anything; emit.h writes it. Throws LayoutError if the topology
  /// cannot hold the model, FormatError if the universal content lacks what
  /// the format needs, UsageError for options it cannot honour (or if
  /// !CanWrite()).
  virtual std::unique_ptr<TargetPlan> PlanTarget(
      const universal::UniversalInput& input,
      const TargetOptions& options) const;
};

/// Plans and writes a target checkpoint of `driver` into `out_dir` (an
/// existing empty folder; wrap it in a universal::StagedDirectory), with
/// ucp.manifest.json when `manifest`. Throws what PlanTarget and Emit throw.
TargetSummary WriteTarget(const Driver& driver,
                          const universal::UniversalInput& input,
                          const std::filesystem::path& out_dir,
                          const TargetOptions& options,
                          const reshape::ExecutorOptions& executor,
                          bool manifest = false);

/// Adds a driver to the registry. Throws InternalError on a duplicate name.
void RegisterDriver(std::unique_ptr<Driver> driver);
/// Every registered driver, by name.
std::vector<const Driver*> Drivers();
/// nullptr if there is none of that name.
const Driver* FindDriver(std::string_view name);
/// Throws UsageError naming the known drivers if there is none.
const Driver& GetDriver(std::string_view name);
/// The driver of the checkpoint at `path`: `from` if given (GetDriver), else
/// the most confident probe among the drivers that recognise it, leaving out
/// a format another of them refines (Driver::Refines). Throws FormatError
/// naming the path and the formats tried if no driver recognises it, or if
/// two are equally sure.
const Driver& DetectDriver(const std::filesystem::path& path,
                           std::string_view from = {});

/// A checkpoint of a save folder and the driver that lists it.
struct ListedCheckpoint {
  const Driver* driver = nullptr;
  SavedCheckpoint checkpoint;
};
/// Every checkpoint the readable drivers list in save folder `dir`
/// (Driver::ListCheckpoints), in registry order; a checkpoint (folder name)
/// that a refining format lists is not listed again for the format it
/// refines. Never throws.
std::vector<ListedCheckpoint> ListSavedCheckpoints(
    const std::filesystem::path& dir);

namespace internal {
struct Registrar {
  explicit Registrar(std::unique_ptr<Driver> driver) {
    RegisterDriver(std::move(driver));
  }
};
}  // namespace internal

}  // namespace ucp::formats

/// In a driver's .cc: registers one instance of `Type` at start-up.
#define UCP_REGISTER_DRIVER(Type)                                          \
  static ::ucp::formats::internal::Registrar ucp_driver_registrar_##Type { \
    std::make_unique<Type>()                                               \
  }
