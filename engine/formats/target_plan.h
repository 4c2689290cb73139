#pragma once
// The write side of every driver, as data: a driver plans a target
// checkpoint (Driver::PlanTarget) as a TargetPlan, a list of units (target
// ranks, say) each planned into files; a file is a container whose contents
// are known bytes and tensor slots (reshape::Job) the executor fills from the
// universal content. One engine stage (emit.h) executes every plan: batches,
// runs the executor within --memory, writes, fsyncs (not with --no-sync),
// commits in the plan's order and writes ucp.manifest.json when asked.
//
// Planning does no output I/O: a plan can be built and inspected in tests
// (graphs, slots, names) without writing a byte. Containers:
//   TorchSaveFile     one torch.save archive (torchfile/torch_writer.h)
//   TorchSaveRunFile  several torch.save archives back to back in one file
//                     (a PyTorch DCP .distcp file); archive i starts where
//                     archive i - 1 ends, the first at 0
//   RawFile           segments of known bytes and tensor slots back to back
//                     (safetensors, protobuf records, text and JSON files)

#include <cstddef>
#include <cstdint>
#include <deque>
#include <filesystem>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "engine/core/dtype.h"
#include "engine/json/json.h"
#include "engine/pickle/value.h"
#include "engine/reshape/executor.h"
#include "engine/torchfile/torch_writer.h"

namespace ucp {
class OutputFile;
}
namespace ucp::torchfile {
class TorchFile;
}
namespace ucp::formats {

class GraphImporter;

/// Where a torch.save archive lies in a file.
struct ArchiveSpan {
  uint64_t offset = 0;
  uint64_t length = 0;
};

/// One file of a target checkpoint, planned.
class PlannedFile {
 public:
  /// `path` is relative to the output folder.
  explicit PlannedFile(std::filesystem::path path);
  virtual ~PlannedFile();
  PlannedFile(const PlannedFile&) = delete;
  PlannedFile& operator=(const PlannedFile&) = delete;

  const std::filesystem::path& path() const noexcept { return path_; }
  /// The tensor slots; their sinks are set by Open().
  std::vector<reshape::Job>& jobs() noexcept { return jobs_; }
  const std::vector<reshape::Job>& jobs() const noexcept { return jobs_; }

  /// Creates the file under a temporary name at out_dir / path() (making its
  /// folders), writes its known bytes and points every slot's sink into it.
  /// Throws IoError; UsageError / InternalError for an inconsistent plan.
  virtual void Open(const std::filesystem::path& out_dir) = 0;
  /// After the slots were filled: completes the file, fsyncs it (unless
  /// --no-sync) and renames it into place. Throws UsageError naming a slot
  /// left incomplete, IoError.
  virtual void Commit() = 0;
  /// The torch.save archives in the file (none for other containers).
  virtual std::vector<ArchiveSpan> archives() const { return {}; }

 protected:
  /// The full path once Open() was called.
  std::filesystem::path Destination(const std::filesystem::path& out_dir);

  std::filesystem::path path_;
  std::vector<reshape::Job> jobs_;
};

/// A torch.save object graph being planned: tensors are slots (filled by the
/// executor), constants (known bytes) or imports (tensors of objects copied
/// from opaque blobs or other torch files, copied when the file is opened).
class TorchArchive {
 public:
  /// `name` names the archive (its file) in messages; its stem is the
  /// archive folder unless `options.archive_name` says otherwise.
  explicit TorchArchive(std::filesystem::path name,
                        torchfile::TorchWriterOptions options = {});
  ~TorchArchive();
  TorchArchive(TorchArchive&&) noexcept;
  TorchArchive& operator=(TorchArchive&&) noexcept;

  pickle::Arena& arena() noexcept;
  /// A tensor node (a plain tensor of `tensor`'s dtype and shape, unless
  /// `spec` says more: a Parameter, requires_grad, or another shape of as
  /// many elements) filled by `tensor`'s ops.
  /// The slot is appended to `jobs`.
  pickle::Value* AddTensor(reshape::TargetTensor tensor,
                           std::vector<reshape::Job>& jobs);
  pickle::Value* AddTensor(reshape::TargetTensor tensor,
                           const torchfile::TensorSpec& spec,
                           std::vector<reshape::Job>& jobs);
  /// A tensor node holding `bytes` (row-major, little-endian).
  pickle::Value* AddConstant(DType dtype, const Shape& shape,
                             std::vector<std::byte> bytes);
  /// A copy of `value`, a node of `file`, in this graph.
  pickle::Value* Import(std::shared_ptr<const torchfile::TorchFile> file,
                        const pickle::Value* value);
  void SetRoot(const pickle::Value* root) noexcept { root_ = root; }
  const pickle::Value* root() const noexcept { return root_; }
  /// The index into `jobs` of the slot filling tensor node `node`, or -1.
  int64_t SlotOf(const pickle::Value* node) const noexcept;
  /// The spec of a tensor node (slot, constant or import), nullptr if none.
  const torchfile::TensorSpec* SpecOf(const pickle::Value* node) const noexcept;

  // The emit stage (emit.h) and containers.
  /// Pickles and plans the archive under `path`; returns its size. Throws
  /// UsageError / InternalError for a graph without root or with foreign
  /// storages.
  uint64_t Prepare(const std::filesystem::path& path);
  /// After Prepare: opens the archive in its own file, or in `shared` at
  /// `offset`; writes the known bytes and points this archive's slots among
  /// `jobs` at it. Throws IoError.
  void Open(std::vector<reshape::Job>& jobs);
  void OpenIn(std::shared_ptr<OutputFile> shared, uint64_t offset,
              std::vector<reshape::Job>& jobs);
  void Commit();
  /// After OpenIn: as TorchWriter::Commit(carry).
  void Commit(torchfile::ZipWriter::PendingRun& carry);

 private:
  void WriteKnown(std::vector<reshape::Job>& jobs);

  std::unique_ptr<torchfile::TorchWriter> writer_;
  std::unique_ptr<GraphImporter> importer_;
  const pickle::Value* root_ = nullptr;
  // The slots: (index into the file's jobs, tensor node).
  std::vector<std::pair<size_t, const pickle::Value*>> slots_;
  std::vector<std::pair<const pickle::Value*, std::vector<std::byte>>>
      constants_;
  std::deque<std::unique_ptr<reshape::ByteSink>> sinks_;
};

/// One torch.save archive.
class TorchSaveFile : public PlannedFile {
 public:
  explicit TorchSaveFile(std::filesystem::path path,
                         torchfile::TorchWriterOptions options = {});
  ~TorchSaveFile() override;

  TorchArchive& archive() noexcept { return archive_; }
  pickle::Arena& arena() noexcept { return archive_.arena(); }
  pickle::Value* AddTensor(reshape::TargetTensor tensor) {
    return archive_.AddTensor(std::move(tensor), jobs_);
  }
  pickle::Value* AddTensor(reshape::TargetTensor tensor,
                           const torchfile::TensorSpec& spec) {
    return archive_.AddTensor(std::move(tensor), spec, jobs_);
  }
  pickle::Value* AddConstant(DType dtype, const Shape& shape,
                             std::vector<std::byte> bytes) {
    return archive_.AddConstant(dtype, shape, std::move(bytes));
  }
  pickle::Value* Import(std::shared_ptr<const torchfile::TorchFile> file,
                        const pickle::Value* value) {
    return archive_.Import(std::move(file), value);
  }
  void SetRoot(const pickle::Value* root) noexcept { archive_.SetRoot(root); }
  const pickle::Value* root() const noexcept { return archive_.root(); }
  /// The slot filling tensor node `node`, nullptr if it is none.
  const reshape::TargetTensor* SlotOf(const pickle::Value* node) const;

  void Open(const std::filesystem::path& out_dir) override;
  void Commit() override;
  std::vector<ArchiveSpan> archives() const override;

 private:
  TorchArchive archive_;
  uint64_t size_ = 0;
};

/// Several torch.save archives back to back in one file.
class TorchSaveRunFile : public PlannedFile {
 public:
  explicit TorchSaveRunFile(std::filesystem::path path);
  ~TorchSaveRunFile() override;

  /// A new archive at the end of the file; `options.archive_name` names its
  /// archive folder ("archive" if empty, as torch.save to a buffer writes).
  TorchArchive& AddArchive(torchfile::TorchWriterOptions options = {});
  size_t size() const noexcept { return archives_.size(); }
  /// Archive i's graph (UsageError for a raw archive).
  TorchArchive& archive(size_t i);
  /// A slot of archive i (its job is appended to jobs()).
  pickle::Value* AddTensor(size_t i, reshape::TargetTensor tensor);
  /// The same with the tensor's spec (its shape may differ from the slot's
  /// when the element count is the same: a [1, n] chunk filled as [n]).
  pickle::Value* AddTensor(size_t i, reshape::TargetTensor tensor,
                           const torchfile::TensorSpec& spec);
  /// A new archive at the end of the file whose bytes are known (a torch.save
  /// archive kept verbatim, such as a DCP BYTE_IO item); returns its index.
  size_t AddRawArchive(std::string bytes);
  /// Plans every archive (their graphs are final then: no tensor or archive
  /// can be added) and their offsets; returns the file size. Open does it
  /// if the planner did not (a planner that records where each archive lies,
  /// as DCP's .metadata does, calls it). Throws like TorchArchive::Prepare.
  uint64_t Layout();
  /// Where archive i lies (after Layout).
  ArchiveSpan span(size_t i) const { return archives_.at(i).span; }

  void Open(const std::filesystem::path& out_dir) override;
  void Commit() override;
  std::vector<ArchiveSpan> archives() const override;

 private:
  struct Entry {
    std::optional<TorchArchive> archive;  // absent: raw
    std::string raw;
    ArchiveSpan span;
  };
  std::deque<Entry> archives_;
  std::shared_ptr<OutputFile> out_;
  uint64_t size_ = 0;
  bool laid_out_ = false;
};

/// Known bytes and tensor slots back to back.
class RawFile : public PlannedFile {
 public:
  explicit RawFile(std::filesystem::path path);
  ~RawFile() override;
  /// Appends known bytes; returns their offset in the file.
  uint64_t AddBytes(std::string bytes);
  /// Appends a slot (NumBytes(tensor) bytes); returns its offset.
  uint64_t AddTensor(reshape::TargetTensor tensor);
  uint64_t size() const noexcept { return size_; }
  /// The known bytes and slot sizes in order (tests): {offset, bytes or
  /// empty, slot index or -1}.
  struct Segment {
    uint64_t offset = 0;
    uint64_t length = 0;
    std::string bytes;  // known bytes
    int64_t slot = -1;  // index into jobs()
  };
  const std::vector<Segment>& segments() const noexcept { return segments_; }

  void Open(const std::filesystem::path& out_dir) override;
  void Commit() override;

 private:
  std::vector<Segment> segments_;
  uint64_t size_ = 0;
  std::unique_ptr<OutputFile> out_;
  std::deque<std::unique_ptr<reshape::ByteSink>> sinks_;
};

/// A small text file (a tracker, JSON metadata).
std::unique_ptr<PlannedFile> TextFile(std::filesystem::path path,
                                      std::string text);

/// What a written target was.
struct TargetSummary {
  int64_t files = 0;  // written (rank files, trackers, metadata)
  uint64_t bytes = 0;
  std::vector<std::string> notes;
  /// How to resume from the output with the framework, one line; the text
  /// "<output>" stands for the output folder.
  std::string resume_hint;
  json::Value details = json::Value::Object();  // driver-specific, for --json
};

/// A target checkpoint, planned: units (target ranks, say) in commit order;
/// each unit's files are committed in the order Plan gives them, so the
/// trackers and metadata a plan lists last are committed last.
class TargetPlan {
 public:
  virtual ~TargetPlan() = default;
  virtual size_t units() const = 0;
  /// Plans the files of unit `i` (< units()). Reads small objects of the
  /// universal content (blobs) but writes nothing. Throws FormatError /
  /// LayoutError naming the file and param, like the drivers' writers.
  virtual std::vector<std::unique_ptr<PlannedFile>> Plan(size_t i) const = 0;
  /// The folder (relative to the output) ucp.manifest.json describes: the
  /// checkpoint folder that Driver::Open finds in the output.
  virtual std::filesystem::path checkpoint_dir() const { return {}; }
  /// Notes (complete once every unit was planned), resume hint, details;
  /// files and bytes are counted by the emit stage.
  virtual TargetSummary Summary() const = 0;
  /// Progress label: "writing rank files of global_step2".
  virtual std::string label() const { return "writing"; }
};

}  // namespace ucp::formats
