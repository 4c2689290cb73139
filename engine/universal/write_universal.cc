#include "engine/universal/write_universal.h"

#include <algorithm>
#include <cctype>
#include <charconv>
#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <utility>

#include "engine/core/error.h"
#include "engine/core/file.h"
#include "engine/core/hash.h"
#include "engine/core/progress.h"
#include "engine/universal/classify.h"
#include "engine/universal/sources.h"

namespace ucp::universal {

namespace {
std::string AtomName(const AtomPlan& a) {
  return StrCat("param ", a.param, " > ", a.state_kind);
}
}  // namespace

namespace internal {

// Splits an atom's fragments into primaries and replicas and checks that the
// primaries cover the atom (and its padding rows) exactly.
Classified Classify(const AtomPlan& atom) {
  Classified c;
  for (const Fragment& f : atom.fragments) {
    const Shape& region = f.pad ? atom.pad_shape : atom.shape;
    UCP_CHECK(BoxInside(f.atom_box, region), AtomName(atom), ": fragment ",
              f.where, " box ", f.atom_box.ToString(), " outside the atom");
    UCP_CHECK(BoxInside(f.src_box, f.src.shape), AtomName(atom), ": fragment ",
              f.where, " source box ", f.src_box.ToString(),
              " outside its tensor");
    UCP_CHECK(f.src_box.size == f.atom_box.size, AtomName(atom),
              ": fragment box sizes differ");
    if (f.atom_box.empty()) continue;
    std::vector<const Fragment*>& list = f.pad ? c.pad : c.main;
    const Fragment* same = nullptr;
    for (const Fragment* p : list) {
      if (!Intersect(p->atom_box, f.atom_box)) continue;
      if (p->atom_box == f.atom_box) {
        same = p;
        break;
      }
      throw FormatError(AtomName(atom), ": ", p->where, " and ", f.where,
                        " hold overlapping but different regions ",
                        p->atom_box.ToString(), " and ", f.atom_box.ToString());
    }
    if (same != nullptr) {
      c.replicas.emplace_back(&f, same);
    } else {
      list.push_back(&f);
    }
  }
  auto check_cover = [&](const std::vector<const Fragment*>& list,
                         const Shape& shape, const char* what) {
    int64_t covered = 0;
    for (const Fragment* f : list) covered += f->atom_box.NumElements();
    const int64_t total = NumElements(shape);
    if (covered != total) {
      throw FormatError(AtomName(atom), ": the rank files hold ", covered,
                        " of the ", total, " elements of the ", what,
                        " (a rank file or a tensor is missing)");
    }
  };
  check_cover(c.main, atom.shape, "tensor");
  if (!atom.pad_shape.empty()) {
    check_cover(c.pad, atom.pad_shape, "padding rows");
  }
  return c;
}

std::vector<Classified> ClassifyAll(const SourcePlan& plan) {
  std::vector<Classified> out;
  out.reserve(plan.atoms.size());
  for (const AtomPlan& a : plan.atoms) out.push_back(Classify(a));
  return out;
}

}  // namespace internal
namespace {

using internal::Classified;
using internal::ClassifyAll;

class NullSink : public reshape::ByteSink {
 public:
  void Write(uint64_t, std::span<const std::byte>) override {}
};

reshape::CopyOp OpOf(const Fragment& f) {
  return reshape::CopyOp{f.src, f.src_box, f.atom_box, 0, {}};
}

// A fragment's region alone, as a tensor of its own (row-major in the box),
// for the replica checks.
reshape::TargetTensor RegionTensor(const AtomPlan& a, const Fragment& f) {
  reshape::TargetTensor t{AtomName(a) + " (replica check of " + f.where + ")",
                          a.dtype,
                          f.atom_box.size,
                          {}};
  t.ops.push_back(
      reshape::CopyOp{f.src, f.src_box, Box::Whole(f.atom_box.size), 0, {}});
  return t;
}

// The file and zip record a source reads, when it is a torch.save storage
// in a zip archive.
std::optional<std::pair<std::string, std::string>> ZipRecordOf(
    const reshape::ByteSource* source) {
  const auto* storage = dynamic_cast<const TorchStorageSource*>(source);
  return storage != nullptr ? storage->ZipRecord() : std::nullopt;
}

struct Check {
  size_t copy_job, primary_job;
  const Fragment* copy;
  const Fragment* primary;
  const AtomPlan* atom;
};

// Appends jobs hashing each replica's region and its primary's (once per
// primary), for the pairs `which` takes (all without it); returns the pairs
// to compare once the jobs ran.
using Replica = std::pair<const Fragment*, const Fragment*>;  // copy, primary
std::vector<Check> AddReplicaChecks(
    const SourcePlan& plan, const std::vector<Classified>& classified,
    reshape::ByteSink* null_sink, std::vector<reshape::Job>& jobs,
    const std::function<bool(const Replica&)>& which = {}) {
  std::vector<Check> checks;
  std::map<const Fragment*, size_t> primary_job;
  auto region_job = [&](const Fragment* f, const AtomPlan& a) {
    reshape::Job job;
    job.tensor = RegionTensor(a, *f);
    job.sink = null_sink;
    job.hash = true;
    jobs.push_back(std::move(job));
    return jobs.size() - 1;
  };
  for (size_t i = 0; i < plan.atoms.size(); ++i) {
    for (const auto& [copy, primary] : classified[i].replicas) {
      if (which && !which({copy, primary})) continue;
      auto it = primary_job.find(primary);
      const size_t pj =
          it != primary_job.end()
              ? it->second
              : (primary_job[primary] = region_job(primary, plan.atoms[i]));
      checks.push_back(
          {region_job(copy, plan.atoms[i]), pj, copy, primary, &plan.atoms[i]});
    }
  }
  return checks;
}

void ThrowReplicasDiffer(const AtomPlan& atom, const Fragment& copy,
                         const Fragment& primary) {
  throw FormatError(AtomName(atom), ": replicas differ: ", primary.where,
                    " and ", copy.where, " hold different values for ",
                    primary.atom_box.ToString());
}

void CompareReplicas(const std::vector<Check>& checks,
                     const std::vector<reshape::Job>& jobs) {
  for (const Check& c : checks) {
    if (jobs[c.copy_job].xxh3 != jobs[c.primary_job].xxh3) {
      ThrowReplicasDiffer(*c.atom, *c.copy, *c.primary);
    }
  }
}

// A zip record's source that notes the CRC-32 of every range read from it.
class CrcNotingSource : public reshape::ByteSource {
 public:
  CrcNotingSource(const reshape::ByteSource& inner,
                  std::pair<std::string, std::string> record)
      : inner_(inner), record_(std::move(record)) {}
  void Read(uint64_t offset, std::span<std::byte> dst) const override {
    inner_.Read(offset, dst);
    const uint32_t crc = torchfile::Crc32(dst);
    const std::lock_guard<std::mutex> lock(mu_);
    pieces_.push_back({offset, dst.size(), crc});
  }
  std::string Describe() const override { return inner_.Describe(); }
  void MoveInto(torchfile::RecordCrcs& crcs) {
    auto& list = crcs[record_.first][record_.second];
    list.insert(list.end(), pieces_.begin(), pieces_.end());
    pieces_.clear();
  }

 private:
  const reshape::ByteSource& inner_;
  std::pair<std::string, std::string> record_;
  mutable std::mutex mu_;
  mutable std::vector<torchfile::CrcPiece> pieces_;
};

// The XXH3-64 of a fragment's raw source bytes, fed by a pass that reads its
// zip record whole in increasing order (the region's bytes, in row-major
// order of its box, lie at increasing offsets of the record).
class RegionStream {
 public:
  // Nothing when the fragment does not lie in a zip record.
  static std::optional<RegionStream> Of(const SourcePlan& plan,
                                        const AtomPlan& atom,
                                        const Fragment& f) {
    std::optional<std::pair<std::string, std::string>> record =
        ZipRecordOf(plan.sources[f.src.source].get());
    if (!record) return std::nullopt;
    // A strided region whose elements are not consecutive in the record is
    // read instead (its runs would be one per element).
    if (!f.src.stride.empty() && f.src.stride.back() != 1) return std::nullopt;
    RegionStream r;
    r.record_ = *std::move(record);
    const reshape::TargetTensor t = RegionTensor(atom, f);
    const uint64_t size = ElementSize(f.src.dtype);
    for (const reshape::Run& run : reshape::OpRuns(t, t.ops[0])) {
      const uint64_t begin =
          f.src.byte_offset + static_cast<uint64_t>(run.src) * size;
      const uint64_t end = begin + static_cast<uint64_t>(run.n) * size;
      if (!r.runs_.empty() && begin < r.runs_.back().second) {
        return std::nullopt;  // not in increasing order: read it instead
      }
      if (!r.runs_.empty() && begin == r.runs_.back().second) {
        r.runs_.back().second = end;
      } else {
        r.runs_.emplace_back(begin, end);
      }
      r.total_ += end - begin;
    }
    return r;
  }

  const std::pair<std::string, std::string>& record() const { return record_; }

  // Takes the part of the region in `bytes` (at `offset` of the record); a
  // chunk that skips bytes of the region leaves it incomplete.
  void Feed(uint64_t offset, std::span<const std::byte> bytes) {
    const uint64_t end = offset + bytes.size();
    while (next_ < runs_.size()) {
      const auto [run_begin, run_end] = runs_[next_];
      const uint64_t from = std::max(run_begin, at_);
      if (from >= end || from < offset) return;
      const uint64_t to = std::min(run_end, end);
      hasher_.Update(bytes.data() + (from - offset), to - from);
      fed_ += to - from;
      at_ = to;
      if (to < run_end) return;
      ++next_;
    }
  }

  // The digest, or nothing if the pass did not show every byte.
  std::optional<uint64_t> Digest() const {
    return fed_ == total_ ? std::optional(hasher_.Digest()) : std::nullopt;
  }

 private:
  std::pair<std::string, std::string> record_;       // file, record
  std::vector<std::pair<uint64_t, uint64_t>> runs_;  // [begin, end) in order
  size_t next_ = 0;                                  // first run not wholly fed
  uint64_t at_ = 0;                                  // record offset fed up to
  uint64_t fed_ = 0, total_ = 0;
  Xxh3Hasher hasher_;
};

// The replica pairs whose regions are hashed from the integrity pass's
// whole-record reads, and the observers feeding them.
class StreamedReplicas {
 public:
  StreamedReplicas(const SourcePlan& plan,
                   const std::vector<Classified>& classified) {
    for (size_t i = 0; i < plan.atoms.size(); ++i) {
      const AtomPlan& a = plan.atoms[i];
      for (const Replica& r : classified[i].replicas) {
        if (r.first->src.dtype != r.second->src.dtype) continue;
        RegionStream* copy = Add(plan, a, *r.first);
        RegionStream* primary = copy ? Add(plan, a, *r.second) : nullptr;
        if (primary != nullptr) pairs_.push_back({r, &a});
      }
    }
    for (auto& [fragment, stream] : streams_) {
      if (stream) by_record_[stream->record()].push_back(&*stream);
    }
  }

  // Whether the pair's regions are hashed from the pass (both lie in zip
  // records, raw bytes of one dtype).
  bool Covers(const Replica& r) const {
    return r.first->src.dtype == r.second->src.dtype && Hashed(r.first) &&
           Hashed(r.second);
  }

  torchfile::RecordObservers Observers() {
    return [this](const std::string& file,
                  const std::string& record) -> torchfile::RecordChunkObserver {
      auto it = by_record_.find({file, record});
      if (it == by_record_.end()) return {};
      return [streams = &it->second](uint64_t offset,
                                     std::span<const std::byte> bytes) {
        for (RegionStream* s : *streams) s->Feed(offset, bytes);
      };
    };
  }

  // Compares the pairs the pass showed whole (throws if they differ);
  // returns those it did not, to be read.
  std::vector<Replica> Compare() const {
    std::vector<Replica> unseen;
    for (const auto& [r, atom] : pairs_) {
      const std::optional<uint64_t> copy = streams_.at(r.first)->Digest();
      const std::optional<uint64_t> primary = streams_.at(r.second)->Digest();
      if (!copy || !primary) {
        unseen.push_back(r);
      } else if (*copy != *primary) {
        ThrowReplicasDiffer(*atom, *r.first, *r.second);
      }
    }
    return unseen;
  }

 private:
  RegionStream* Add(const SourcePlan& plan, const AtomPlan& a,
                    const Fragment& f) {
    auto it = streams_.find(&f);
    if (it == streams_.end()) {
      it = streams_.emplace(&f, RegionStream::Of(plan, a, f)).first;
    }
    return it->second ? &*it->second : nullptr;
  }

  std::map<const Fragment*, std::optional<RegionStream>> streams_;
  std::map<std::pair<std::string, std::string>, std::vector<RegionStream*>>
      by_record_;
  bool Hashed(const Fragment* f) const {
    auto it = streams_.find(f);
    return it != streams_.end() && it->second.has_value();
  }

  std::vector<std::pair<Replica, const AtomPlan*>> pairs_;
};

std::vector<const reshape::ByteSource*> SourceList(const SourcePlan& plan) {
  std::vector<const reshape::ByteSource*> sources;
  for (const auto& s : plan.sources) sources.push_back(s.get());
  return sources;
}

uint64_t TotalBytes(const std::vector<reshape::Job>& jobs) {
  uint64_t total = 0;
  for (const reshape::Job& j : jobs) total += reshape::NumBytes(j.tensor);
  return total;
}

}  // namespace

VerifySummary VerifySource(const SourcePlan& plan,
                           const reshape::ExecutorOptions& options,
                           const IntegrityPass& integrity) {
  return internal::VerifyClassified(plan, ClassifyAll(plan), options,
                                    integrity);
}

VerifySummary internal::VerifyClassified(
    const SourcePlan& plan, const std::vector<Classified>& classified,
    const reshape::ExecutorOptions& options, const IntegrityPass& integrity) {
  VerifySummary s;
  for (size_t i = 0; i < plan.atoms.size(); ++i) {
    const AtomPlan& a = plan.atoms[i];
    s.atoms += 1;
    s.atom_bytes +=
        static_cast<uint64_t>(NumElements(a.shape)) * ElementSize(a.dtype);
    s.replicas_verified += static_cast<int64_t>(classified[i].replicas.size());
  }
  // Reads the regions of the replicas `which` takes (and, when the integrity
  // pass reads only what was not read, notes their CRC-32s), then compares.
  NullSink null_sink;
  auto read_and_compare = [&](const std::function<bool(const Replica&)>& which,
                              torchfile::RecordCrcs* crcs,
                              const std::function<void()>& before_compare) {
    std::vector<reshape::Job> jobs;
    std::vector<Check> checks =
        AddReplicaChecks(plan, classified, &null_sink, jobs, which);
    std::vector<const reshape::ByteSource*> sources = SourceList(plan);
    std::vector<std::unique_ptr<CrcNotingSource>> noting;
    for (const reshape::ByteSource*& src : sources) {
      auto record = crcs != nullptr ? ZipRecordOf(src) : std::nullopt;
      if (!record) continue;
      noting.push_back(
          std::make_unique<CrcNotingSource>(*src, *std::move(record)));
      src = noting.back().get();
    }
    if (!jobs.empty()) {
      Progress progress("verify", TotalBytes(jobs));
      reshape::ExecutorOptions opts = options;
      opts.progress = &progress;
      reshape::Execute(jobs, sources, opts);
      progress.Finish();
    }
    if (crcs != nullptr) {
      for (auto& n : noting) n->MoveInto(*crcs);
    }
    if (before_compare) before_compare();
    CompareReplicas(checks, jobs);
  };

  if (!integrity.whole_records || !integrity.run) {
    torchfile::RecordCrcs crcs;
    read_and_compare({}, integrity.run ? &crcs : nullptr, [&] {
      if (integrity.run) integrity.run(crcs, {});
    });
    return s;
  }
  // The integrity pass reads every record whole: the replicas it can show
  // are hashed from its reads; the others are read first, as above.
  StreamedReplicas streamed(plan, classified);
  read_and_compare([&](const Replica& r) { return !streamed.Covers(r); },
                   nullptr, [&] { integrity.run({}, streamed.Observers()); });
  const std::vector<Replica> unseen = streamed.Compare();
  if (!unseen.empty()) {
    read_and_compare([unseen = std::set<Replica>(unseen.begin(), unseen.end())](
                         const Replica& r) { return unseen.count(r) != 0; },
                     nullptr, {});
  }
  return s;
}

namespace {

// The hidden part files of a job writing one universal file, beside its
// temporary file (named after it: reclaimed with it, staging.h).
std::filesystem::path OffsetsPart(const std::filesystem::path& temp) {
  return temp.string() + ".offsets";
}
std::filesystem::path HashesPart(const std::filesystem::path& temp, int rank) {
  return StrCat(temp.string(), ".xxh3-", rank);
}

// Removes rank 0's part files when it leaves (committed or not).
struct PartFiles {
  std::filesystem::path temp;
  int world = 0;
  ~PartFiles() {
    if (temp.empty()) return;
    std::error_code ignored;
    std::filesystem::remove(OffsetsPart(temp), ignored);
    for (int r = 1; r < world; ++r)
      std::filesystem::remove(HashesPart(temp, r), ignored);
  }
};

// "<id> <xxh3>" lines, both in hex.
std::string HashLines(
    const std::vector<std::pair<atoms::DatasetId, uint64_t>>& hashes) {
  std::string text;
  for (const auto& [id, h] : hashes)
    text += StrCat(HashHex(id), " ", HashHex(h), "\n");
  return text;
}

// Parses unsigned integers separated by whitespace (base 10 or 16); throws
// FormatError naming `file` on anything else.
std::vector<uint64_t> ParseNumbers(const std::string& text, int base,
                                   const std::filesystem::path& file) {
  std::vector<uint64_t> out;
  size_t at = 0;
  while (at < text.size()) {
    if (std::isspace(static_cast<unsigned char>(text[at]))) {
      ++at;
      continue;
    }
    const char* begin = text.data() + at;
    const char* end = text.data() + text.size();
    uint64_t v = 0;
    const auto r = std::from_chars(begin, end, v, base);
    if (r.ec != std::errc() ||
        (r.ptr != end && !std::isspace(static_cast<unsigned char>(*r.ptr)))) {
      throw FormatError(file.string(), ": not a number at byte ", at);
    }
    out.push_back(v);
    at = static_cast<size_t>(r.ptr - text.data());
  }
  return out;
}

// A job's part file read back, checked against the xxh3 its writer reported.
std::string ReadPart(const std::filesystem::path& file, const std::string& want,
                     const std::string& who) {
  std::string text = ReadSmallFile(file, size_t{1} << 30);
  if (HashHex(Xxh3(text.data(), text.size())) != want) {
    throw IoError(file.string(), ": the part file ", who,
                  " wrote has another xxh3 than it reported (",
                  HashHex(Xxh3(text.data(), text.size())), ", not ", want,
                  "; the processes do not see the same folder?)");
  }
  return text;
}

}  // namespace

WriteSummary WriteUniversal(const SourcePlan& plan,
                            const std::filesystem::path& path,
                            const reshape::ExecutorOptions& options,
                            UniversalJob* job) {
  const auto start = std::chrono::steady_clock::now();
  std::vector<Classified> classified = ClassifyAll(plan);
  const bool leader = job == nullptr || job->rank() == 0;

  atoms::AtomStoreWriter writer =
      leader ? atoms::AtomStoreWriter::Create(path)
             : atoms::AtomStoreWriter::CreateShared(path);
  if (job != nullptr && leader) job->Staging(writer.temp_path());
  writer.SetRoot(RootFromModel(plan.model));
  for (const atoms::ParamInfo& p : plan.params) writer.AddParam(p);
  std::vector<atoms::DatasetId> atom_ids;
  std::vector<std::optional<atoms::DatasetId>> pad_ids;
  for (const AtomPlan& a : plan.atoms) {
    atom_ids.push_back(writer.AddAtom(a.param, a.state_kind, a.dtype, a.shape));
    pad_ids.push_back(a.pad_shape.empty()
                          ? std::nullopt
                          : std::optional(writer.AddPadAtom(
                                a.param, a.state_kind, a.dtype, a.pad_shape)));
  }
  std::vector<atoms::DatasetId> opaque_ids;
  for (const OpaqueBlob& b : plan.opaque) {
    opaque_ids.push_back(writer.AddOpaque(b.key, b.bytes.size()));
  }

  // Which process writes which dataset (all this one's without a job).
  std::vector<int> owner(writer.num_datasets(), 0);
  PartFiles parts;
  // A failure is reported to the job while the part files and the
  // temporary file still exist: the others learn this error first, not
  // one of their own about a file that went away.
  try {
    if (job != nullptr) {
      std::vector<UniversalJob::Dataset> loads;
      for (atoms::DatasetId id = 0; id < writer.num_datasets(); ++id) {
        const atoms::DatasetInfo& d = writer.dataset(id);
        loads.push_back(
            {d.path, d.nbytes,
             d.kind != atoms::DatasetKind::kOpaque && d.nbytes > 0});
      }
      owner = job->Assign(loads);
      UCP_CHECK(owner.size() == loads.size(), "an assignment of ", owner.size(),
                " datasets for ", loads.size());
      // Rank 0 allocates; the others write into its file at its offsets.
      if (leader) {
        parts = PartFiles{writer.temp_path(), job->world()};
        job->Staging(OffsetsPart(writer.temp_path()));
        for (int r = 1; r < job->world(); ++r)
          job->Staging(HashesPart(writer.temp_path(), r));
        writer.Allocate();
        std::string text;
        for (atoms::DatasetId id = 0; id < writer.num_datasets(); ++id)
          text += StrCat(writer.dataset(id).offset, "\n");
        WriteFileAtomically(OffsetsPart(writer.temp_path()), text);
        job->Share(
            "universal",
            StrCat(HashHex(Xxh3(text.data(), text.size())), " ",
                   std::filesystem::absolute(writer.temp_path()).string()));
      } else {
        const std::string shared = job->Share("universal", "");
        const size_t space = shared.find(' ');
        UCP_CHECK(space != std::string::npos, "a universal file shared as '",
                  shared, "'");
        const std::filesystem::path temp = shared.substr(space + 1);
        const std::filesystem::path offsets_file = OffsetsPart(temp);
        const std::vector<uint64_t> offsets = ParseNumbers(
            ReadPart(offsets_file, shared.substr(0, space), "rank 0"), 10,
            offsets_file);
        if (offsets.size() != writer.num_datasets()) {
          throw IoError(offsets_file.string(), ": ", offsets.size(),
                        " dataset offsets, this process planned ",
                        writer.num_datasets());
        }
        writer.Attach(temp, offsets);
      }
    } else {
      writer.Allocate();
    }
    const int rank = job != nullptr ? job->rank() : 0;
    const int world = job != nullptr ? job->world() : 1;

    // One hashed job per atom and per pad atom this process writes, writing
    // into the store.
    std::vector<std::unique_ptr<StoreSink>> sinks;
    std::vector<reshape::Job> jobs;
    std::vector<std::pair<atoms::DatasetId, size_t>> hashed;  // dataset, job
    uint64_t atom_bytes = 0;
    uint64_t written = 0;
    auto add_job = [&](std::string name, const AtomPlan& a, const Shape& shape,
                       const std::vector<const Fragment*>& fragments,
                       atoms::DatasetId id) {
      reshape::Job one;
      one.tensor = reshape::TargetTensor{std::move(name), a.dtype, shape, {}};
      for (const Fragment* f : fragments) one.tensor.ops.push_back(OpOf(*f));
      atom_bytes += reshape::NumBytes(one.tensor);
      if (owner[id] != rank) return;
      written += reshape::NumBytes(one.tensor);
      sinks.push_back(std::make_unique<StoreSink>(writer, id));
      one.sink = sinks.back().get();
      one.hash = true;
      hashed.emplace_back(id, jobs.size());
      jobs.push_back(std::move(one));
    };
    for (size_t i = 0; i < plan.atoms.size(); ++i) {
      const AtomPlan& a = plan.atoms[i];
      add_job(AtomName(a), a, a.shape, classified[i].main, atom_ids[i]);
      if (pad_ids[i]) {
        add_job(AtomName(a) + " (padding rows)", a, a.pad_shape,
                classified[i].pad, *pad_ids[i]);
      }
    }
    // This process's share of the replica checks: the k-th by process k mod
    // world.
    size_t k = 0;
    NullSink null_sink;
    std::vector<Check> checks = AddReplicaChecks(
        plan, classified, &null_sink, jobs,
        [&](const Replica&) { return static_cast<int>(k++ % world) == rank; });
    int64_t replicas_checked = static_cast<int64_t>(checks.size());
    if (job != nullptr) {
      replicas_checked = 0;
      for (const Classified& c : classified)
        replicas_checked += static_cast<int64_t>(c.replicas.size());
    }

    Progress progress("to-universal", TotalBytes(jobs));
    reshape::ExecutorOptions opts = options;
    opts.progress = &progress;
    reshape::ExecutorStats stats =
        reshape::Execute(jobs, SourceList(plan), opts);
    progress.Finish();
    CompareReplicas(checks, jobs);

    std::vector<std::pair<atoms::DatasetId, uint64_t>> hashes;
    for (const auto& [id, j] : hashed) hashes.emplace_back(id, jobs[j].xxh3);
    for (size_t i = 0; i < plan.opaque.size(); ++i) {
      if (owner[opaque_ids[i]] != rank) continue;
      const std::string& b = plan.opaque[i].bytes;
      writer.Write(opaque_ids[i], 0,
                   std::as_bytes(std::span<const char>(b.data(), b.size())));
      hashes.emplace_back(opaque_ids[i], Xxh3(b.data(), b.size()));
      written += b.size();
    }
    const int64_t datasets_written = static_cast<int64_t>(hashes.size());
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
            .count();

    if (job != nullptr) {
      // Each process's bytes synced and its hashes in a part file; rank 0
      // gathers them.
      json::Value report = json::Value::Object();
      report["files"] = datasets_written;
      report["bytes"] = written;
      report["bytes_read"] = stats.bytes_read;
      report["seconds"] = seconds;
      if (!leader) {
        writer.SyncWrites();
        const std::string text = HashLines(hashes);
        WriteFileAtomically(HashesPart(writer.temp_path(), rank), text);
        report["xxh3"] = HashHex(Xxh3(text.data(), text.size()));
      }
      const std::vector<json::Value> reports = job->Gather(std::move(report));
      if (!leader) {
        job->Committed();  // waits for rank 0's commit
      } else {
        for (int r = 1; r < world; ++r) {
          const std::filesystem::path file = HashesPart(writer.temp_path(), r);
          const std::string want =
              reports.at(static_cast<size_t>(r)).At("xxh3").AsString();
          const std::vector<uint64_t> v = ParseNumbers(
              ReadPart(file, want, StrCat("process ", r)), 16, file);
          UCP_CHECK(v.size() % 2 == 0, file.string(), ": an odd count");
          for (size_t i = 0; i < v.size(); i += 2) {
            UCP_CHECK(v[i] < writer.num_datasets(), file.string(),
                      ": dataset id ", v[i], " out of range");
            const auto id = static_cast<atoms::DatasetId>(v[i]);
            UCP_CHECK(owner[id] == r, file.string(), ": dataset ",
                      writer.dataset(id).path, " is process ", owner[id],
                      "'s, not ", r, "'s");
            hashes.emplace_back(id, v[i + 1]);
          }
        }
        // Every dataset with bytes hashed exactly once.
        std::vector<int> seen(writer.num_datasets(), 0);
        for (const auto& [id, h] : hashes) ++seen[id];
        for (atoms::DatasetId id = 0; id < writer.num_datasets(); ++id) {
          const atoms::DatasetInfo& d = writer.dataset(id);
          UCP_CHECK(d.nbytes > 0 ? seen[id] == 1 : seen[id] <= 1, "dataset ",
                    d.path, " hashed ", seen[id],
                    " times by the processes of the job (once expected)");
        }
      }
    }
    if (leader) {
      for (const auto& [id, h] : hashes) writer.SetHash(id, h);
      writer.Commit();
      if (job != nullptr) job->Committed();
    }

    WriteSummary s;
    s.params = static_cast<int64_t>(plan.params.size());
    s.atoms = static_cast<int64_t>(plan.atoms.size());
    s.atom_bytes = atom_bytes;
    s.bytes_read = stats.bytes_read;
    s.replicas_verified = replicas_checked;
    s.bytes_written = written;
    s.datasets_written = datasets_written;
    s.seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
            .count();
    return s;
  } catch (const Error& e) {
    if (job != nullptr) job->Failed(e);
    throw;
  }
}

}  // namespace ucp::universal
