#include "engine/universal/write_universal.h"

#include <algorithm>
#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <utility>

#include "engine/core/error.h"
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

WriteSummary WriteUniversal(const SourcePlan& plan,
                            const std::filesystem::path& path,
                            const reshape::ExecutorOptions& options) {
  const auto start = std::chrono::steady_clock::now();
  std::vector<Classified> classified = ClassifyAll(plan);

  atoms::AtomStoreWriter writer = atoms::AtomStoreWriter::Create(path);
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
  writer.Allocate();

  // One hashed job per atom and per pad atom, writing into the store.
  std::vector<std::unique_ptr<StoreSink>> sinks;
  std::vector<reshape::Job> jobs;
  std::vector<std::pair<atoms::DatasetId, size_t>> hashed;  // dataset, job
  uint64_t atom_bytes = 0;
  auto add_job = [&](std::string name, const AtomPlan& a, const Shape& shape,
                     const std::vector<const Fragment*>& fragments,
                     atoms::DatasetId id) {
    reshape::Job job;
    job.tensor = reshape::TargetTensor{std::move(name), a.dtype, shape, {}};
    for (const Fragment* f : fragments) job.tensor.ops.push_back(OpOf(*f));
    sinks.push_back(std::make_unique<StoreSink>(writer, id));
    job.sink = sinks.back().get();
    job.hash = true;
    atom_bytes += reshape::NumBytes(job.tensor);
    hashed.emplace_back(id, jobs.size());
    jobs.push_back(std::move(job));
  };
  for (size_t i = 0; i < plan.atoms.size(); ++i) {
    const AtomPlan& a = plan.atoms[i];
    add_job(AtomName(a), a, a.shape, classified[i].main, atom_ids[i]);
    if (pad_ids[i]) {
      add_job(AtomName(a) + " (padding rows)", a, a.pad_shape,
              classified[i].pad, *pad_ids[i]);
    }
  }
  NullSink null_sink;
  std::vector<Check> checks =
      AddReplicaChecks(plan, classified, &null_sink, jobs);

  Progress progress("to-universal", TotalBytes(jobs));
  reshape::ExecutorOptions opts = options;
  opts.progress = &progress;
  reshape::ExecutorStats stats = reshape::Execute(jobs, SourceList(plan), opts);
  progress.Finish();
  CompareReplicas(checks, jobs);

  for (const auto& [id, job] : hashed) writer.SetHash(id, jobs[job].xxh3);
  for (size_t i = 0; i < plan.opaque.size(); ++i) {
    const std::string& b = plan.opaque[i].bytes;
    writer.Write(opaque_ids[i], 0,
                 std::as_bytes(std::span<const char>(b.data(), b.size())));
    writer.SetHash(opaque_ids[i], Xxh3(b.data(), b.size()));
  }
  writer.Commit();

  WriteSummary s;
  s.params = static_cast<int64_t>(plan.params.size());
  s.atoms = static_cast<int64_t>(plan.atoms.size());
  s.atom_bytes = atom_bytes;
  s.bytes_read = stats.bytes_read;
  s.replicas_verified = static_cast<int64_t>(checks.size());
  s.seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start)
          .count();
  return s;
}

}  // namespace ucp::universal
