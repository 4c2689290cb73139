#include "engine/formats/target_plan.h"

#include <cstring>

#include "engine/core/error.h"
#include "engine/core/file.h"
#include "engine/formats/common/sinks.h"
#include "engine/formats/common/torch_blob.h"
#include "engine/reshape/plan.h"

namespace ucp::formats {
namespace fs = std::filesystem;

namespace {

// Writes a slot's bytes at a fixed offset of a file.
class FileSink : public reshape::ByteSink {
 public:
  FileSink(File& file, uint64_t base) : file_(file), base_(base) {}
  void Write(uint64_t offset, std::span<const std::byte> data) override {
    file_.WriteExact(data.data(), data.size(), base_ + offset);
  }
  bool Copy(uint64_t offset, uint64_t n, const FileLocation& from) override {
    return file_.CopyFrom(*from.file, from.offset, n, base_ + offset);
  }

 private:
  File& file_;
  uint64_t base_;
};

void MakeFolder(const fs::path& dir) {
  std::error_code ec;
  if (dir.empty() || fs::is_directory(dir, ec)) return;
  fs::create_directories(dir, ec);
  if (ec) throw IoError("cannot create ", dir.string(), ": ", ec.message());
}

}  // namespace

// --- PlannedFile -----------------------------------------------------------

PlannedFile::PlannedFile(fs::path path) : path_(std::move(path)) {}
PlannedFile::~PlannedFile() = default;

fs::path PlannedFile::Destination(const fs::path& out_dir) {
  const fs::path full = out_dir / path_;
  MakeFolder(full.parent_path());
  return full;
}

// --- TorchArchive ----------------------------------------------------------

TorchArchive::TorchArchive(fs::path name, torchfile::TorchWriterOptions options)
    : writer_(std::make_unique<torchfile::TorchWriter>(std::move(name),
                                                       std::move(options))),
      importer_(std::make_unique<GraphImporter>(*writer_)) {}
TorchArchive::~TorchArchive() = default;
TorchArchive::TorchArchive(TorchArchive&&) noexcept = default;
TorchArchive& TorchArchive::operator=(TorchArchive&&) noexcept = default;

pickle::Arena& TorchArchive::arena() noexcept { return writer_->arena(); }

pickle::Value* TorchArchive::AddTensor(reshape::TargetTensor tensor,
                                       std::vector<reshape::Job>& jobs) {
  torchfile::TensorSpec spec;
  spec.dtype = tensor.dtype;
  spec.shape = tensor.shape;
  return AddTensor(std::move(tensor), spec, jobs);
}

pickle::Value* TorchArchive::AddTensor(reshape::TargetTensor tensor,
                                       const torchfile::TensorSpec& spec,
                                       std::vector<reshape::Job>& jobs) {
  UCP_CHECK(spec.dtype == tensor.dtype &&
                NumElements(spec.shape) == NumElements(tensor.shape),
            tensor.name, ": tensor spec differs from its slot");
  pickle::Value* node = writer_->NewTensor(spec);
  reshape::Job job;
  job.tensor = std::move(tensor);
  slots_.emplace_back(jobs.size(), node);
  jobs.push_back(std::move(job));
  return node;
}

pickle::Value* TorchArchive::AddConstant(DType dtype, const Shape& shape,
                                         std::vector<std::byte> bytes) {
  pickle::Value* node = ConstantNode(*writer_, dtype, shape, bytes.size());
  constants_.emplace_back(node, std::move(bytes));
  return node;
}

pickle::Value* TorchArchive::Import(
    std::shared_ptr<const torchfile::TorchFile> file,
    const pickle::Value* value) {
  return importer_->Import(std::move(file), value);
}

int64_t TorchArchive::SlotOf(const pickle::Value* node) const noexcept {
  for (const auto& [index, n] : slots_)
    if (n == node) return static_cast<int64_t>(index);
  return -1;
}

const torchfile::TensorSpec* TorchArchive::SpecOf(
    const pickle::Value* node) const noexcept {
  return writer_->FindSpec(node);
}

uint64_t TorchArchive::Prepare(const fs::path& path) {
  UCP_CHECK(root_ != nullptr, path.string(), ": archive without root");
  writer_->SetPath(path);
  return writer_->Prepare(root_);
}

void TorchArchive::WriteKnown(std::vector<reshape::Job>& jobs) {
  importer_->WriteTensors();
  for (const auto& [node, bytes] : constants_)
    writer_->WriteTensorData(node, 0, bytes);
  constants_.clear();
  for (const auto& [index, node] : slots_) {
    UCP_CHECK(index < jobs.size(), "slot ", index, " of ", jobs.size());
    sinks_.push_back(std::make_unique<WriterSink>(*writer_, node));
    jobs[index].sink = sinks_.back().get();
  }
}

void TorchArchive::Open(std::vector<reshape::Job>& jobs) {
  writer_->Open();
  WriteKnown(jobs);
}

void TorchArchive::OpenIn(std::shared_ptr<OutputFile> shared, uint64_t offset,
                          std::vector<reshape::Job>& jobs) {
  writer_->OpenIn(std::move(shared), offset);
  WriteKnown(jobs);
}

void TorchArchive::Commit() { writer_->Commit(); }

void TorchArchive::Commit(torchfile::ZipWriter::PendingRun& carry) {
  writer_->Commit(carry);
}

// --- TorchSaveFile ---------------------------------------------------------

TorchSaveFile::TorchSaveFile(fs::path path,
                             torchfile::TorchWriterOptions options)
    : PlannedFile(path), archive_(path, std::move(options)) {}
TorchSaveFile::~TorchSaveFile() = default;

const reshape::TargetTensor* TorchSaveFile::SlotOf(
    const pickle::Value* node) const {
  const int64_t i = archive_.SlotOf(node);
  return i < 0 ? nullptr : &jobs_[static_cast<size_t>(i)].tensor;
}

void TorchSaveFile::Open(const fs::path& out_dir) {
  size_ = archive_.Prepare(Destination(out_dir));
  archive_.Open(jobs_);
}

void TorchSaveFile::Commit() { archive_.Commit(); }

std::vector<ArchiveSpan> TorchSaveFile::archives() const {
  return {{0, size_}};
}

// --- TorchSaveRunFile ------------------------------------------------------

TorchSaveRunFile::TorchSaveRunFile(fs::path path)
    : PlannedFile(std::move(path)) {}
TorchSaveRunFile::~TorchSaveRunFile() = default;

TorchArchive& TorchSaveRunFile::AddArchive(
    torchfile::TorchWriterOptions options) {
  if (options.archive_name.empty()) options.archive_name = "archive";
  UCP_CHECK(!laid_out_, path_.string(), ": archive added after the layout");
  archives_.push_back(
      Entry{TorchArchive(path_, std::move(options)), std::string(), {}});
  return *archives_.back().archive;
}

size_t TorchSaveRunFile::AddRawArchive(std::string bytes) {
  UCP_CHECK(!laid_out_, path_.string(), ": archive added after the layout");
  archives_.push_back(Entry{std::nullopt, std::move(bytes), {}});
  return archives_.size() - 1;
}

TorchArchive& TorchSaveRunFile::archive(size_t i) {
  Entry& e = archives_.at(i);
  if (!e.archive) {
    throw UsageError(path_.string(), ": archive ", i, " is raw bytes");
  }
  return *e.archive;
}

pickle::Value* TorchSaveRunFile::AddTensor(size_t i,
                                           reshape::TargetTensor tensor) {
  return archive(i).AddTensor(std::move(tensor), jobs_);
}

pickle::Value* TorchSaveRunFile::AddTensor(size_t i,
                                           reshape::TargetTensor tensor,
                                           const torchfile::TensorSpec& spec) {
  return archive(i).AddTensor(std::move(tensor), spec, jobs_);
}

uint64_t TorchSaveRunFile::Layout() {
  if (!laid_out_) {
    uint64_t at = 0;
    for (Entry& e : archives_) {
      const uint64_t n = e.archive ? e.archive->Prepare(path_) : e.raw.size();
      e.span = {at, n};
      at += n;
    }
    size_ = at;
    laid_out_ = true;
  }
  return size_;
}

void TorchSaveRunFile::Open(const fs::path& out_dir) {
  const fs::path full = Destination(out_dir);
  Layout();
  out_ = std::make_shared<OutputFile>(full);
  if (size_ > 0) out_->file().Allocate(size_);
  for (Entry& e : archives_) {
    if (e.archive) {
      e.archive->OpenIn(out_, e.span.offset, jobs_);
    } else {
      out_->file().WriteExact(e.raw.data(), e.raw.size(), e.span.offset);
      std::string().swap(e.raw);  // written: no longer kept
    }
  }
}

void TorchSaveRunFile::Commit() {
  UCP_CHECK(out_ != nullptr, path_.string(), ": Commit before Open");
  // Archive i's directory and archive i + 1's first headers are contiguous:
  // each archive's last run is carried into the next one's first pwrite.
  torchfile::ZipWriter::PendingRun carry;
  for (Entry& e : archives_)
    if (e.archive) e.archive->Commit(carry);
  if (!carry.bytes.empty())
    out_->file().WriteExact(carry.bytes.data(), carry.bytes.size(), carry.at);
  out_->Commit();
  out_.reset();
}

std::vector<ArchiveSpan> TorchSaveRunFile::archives() const {
  std::vector<ArchiveSpan> out;
  for (const Entry& e : archives_) out.push_back(e.span);
  return out;
}

// --- RawFile ---------------------------------------------------------------

RawFile::RawFile(fs::path path) : PlannedFile(std::move(path)) {}
RawFile::~RawFile() = default;

uint64_t RawFile::AddBytes(std::string bytes) {
  Segment s;
  s.offset = size_;
  s.length = bytes.size();
  s.bytes = std::move(bytes);
  size_ += s.length;
  segments_.push_back(std::move(s));
  return segments_.back().offset;
}

uint64_t RawFile::AddTensor(reshape::TargetTensor tensor) {
  Segment s;
  s.offset = size_;
  s.length = reshape::NumBytes(tensor);
  s.slot = static_cast<int64_t>(jobs_.size());
  reshape::Job job;
  job.tensor = std::move(tensor);
  jobs_.push_back(std::move(job));
  size_ += s.length;
  segments_.push_back(std::move(s));
  return segments_.back().offset;
}

void RawFile::Open(const fs::path& out_dir) {
  out_ = std::make_unique<OutputFile>(Destination(out_dir));
  File& f = out_->file();
  if (size_ > 0) f.Allocate(size_);
  for (Segment& s : segments_) {
    if (s.slot >= 0) {
      sinks_.push_back(std::make_unique<FileSink>(f, s.offset));
      jobs_[static_cast<size_t>(s.slot)].sink = sinks_.back().get();
    } else if (!s.bytes.empty()) {
      f.WriteExact(s.bytes.data(), s.bytes.size(), s.offset);
      std::string().swap(s.bytes);  // written: no longer kept
    }
  }
}

void RawFile::Commit() {
  UCP_CHECK(out_ != nullptr, path_.string(), ": Commit before Open");
  out_->Commit();
  out_.reset();
  sinks_.clear();
}

std::unique_ptr<PlannedFile> TextFile(fs::path path, std::string text) {
  auto f = std::make_unique<RawFile>(std::move(path));
  f->AddBytes(std::move(text));
  return f;
}

}  // namespace ucp::formats
