#include "engine/universal/input.h"

#include <algorithm>
#include <map>

#include "engine/core/error.h"
#include "engine/core/file.h"
#include "engine/core/hash.h"
#include "engine/torchfile/torch_file.h"
#include "engine/universal/classify.h"
#include "engine/universal/sources.h"
#include "engine/universal/write_universal.h"

namespace ucp::universal {
namespace {

namespace fs = std::filesystem;

class StoreInputImpl : public UniversalInput {
 public:
  explicit StoreInputImpl(const atoms::AtomStoreReader& store)
      : store_(store),
        sources_(store),
        model_(ModelFromRoot(store.root(), store.path())) {}

  const fs::path& path() const noexcept override { return store_.path(); }
  const Model& model() const noexcept override { return model_; }
  std::span<const atoms::StoredParam> params() const noexcept override {
    return store_.params();
  }
  std::span<const atoms::DatasetInfo> datasets() const noexcept override {
    return store_.datasets();
  }
  const atoms::StoredParam* FindParam(std::string_view fqn) const override {
    return store_.FindParam(fqn);
  }
  const atoms::DatasetInfo* FindAtom(std::string_view fqn,
                                     std::string_view kind) const override {
    return store_.FindAtom(fqn, kind);
  }
  const atoms::DatasetInfo* FindPadAtom(std::string_view fqn,
                                        std::string_view kind) const override {
    return store_.FindPadAtom(fqn, kind);
  }
  const atoms::DatasetInfo* FindOpaque(std::string_view key) const override {
    return store_.FindOpaque(key);
  }
  std::shared_ptr<const torchfile::TorchFile> OpenBlob(
      const atoms::DatasetInfo& blob) const override {
    try {
      return std::make_shared<const torchfile::TorchFile>(
          torchfile::TorchFile::Open(store_.path(), blob.offset, blob.nbytes));
    } catch (Error& e) {
      e.AddContext("universal file ", store_.path().string(), " > opaque ",
                   blob.fqn);
      throw;
    }
  }
  std::string ReadBlob(const atoms::DatasetInfo& blob) const override {
    std::string bytes(blob.nbytes, '\0');
    try {
      if (blob.nbytes > 0)
        File::OpenRead(store_.path())
            .ReadExact(bytes.data(), bytes.size(), blob.offset);
    } catch (Error& e) {
      e.AddContext("universal file ", store_.path().string(), " > opaque ",
                   blob.fqn);
      throw;
    }
    if (Xxh3(bytes.data(), bytes.size()) != blob.xxh3) {
      throw FormatError("universal file ", store_.path().string(), " > opaque ",
                        blob.fqn, ": its bytes do not match their xxh3 (",
                        "damaged)");
    }
    return bytes;
  }
  reshape::SourceTensor Tensor(const atoms::DatasetInfo& d) const override {
    return sources_.Tensor(d);
  }
  reshape::ExecutorStats Run(
      std::span<reshape::Job> jobs,
      const reshape::ExecutorOptions& options) const override {
    std::vector<const reshape::ByteSource*> list = sources_.list();
    return reshape::Execute(jobs, list, options);
  }

 private:
  const atoms::AtomStoreReader& store_;
  StoreSources sources_;
  Model model_;
};

class PlanInputImpl : public UniversalInput {
 public:
  PlanInputImpl(const SourcePlan& plan, fs::path path,
                const reshape::ExecutorOptions& options, ReplicaShare share)
      : plan_(plan), path_(std::move(path)) {
    // Coverage and replicas, as to-universal (this process's share of the
    // replicas).
    std::vector<internal::Classified> classified = internal::ClassifyAll(plan);
    if (share.count > 1) {
      std::vector<internal::Classified> mine = classified;
      size_t k = 0;
      for (internal::Classified& c : mine) {
        std::erase_if(c.replicas, [&](const auto&) {
          return static_cast<int>(k++ % static_cast<size_t>(share.count)) !=
                 share.index;
        });
      }
      internal::VerifyClassified(plan, mine, options);
    } else {
      internal::VerifyClassified(plan, classified, options);
    }
    std::map<std::string, size_t> param_index;
    for (const atoms::ParamInfo& p : plan.params) {
      param_index[p.fqn] = params_.size();
      params_.push_back(atoms::StoredParam{p, {}, {}});
    }
    for (size_t i = 0; i < plan.atoms.size(); ++i) {
      const AtomPlan& a = plan.atoms[i];
      internal::Classified& c = classified[i];
      const auto pi = param_index.find(a.param);
      UCP_CHECK(pi != param_index.end(), "atom of unknown param ", a.param);
      atoms::StoredParam& sp = params_[pi->second];
      sp.atoms.push_back(Add(atoms::DatasetKind::kAtom, a.param, a.state_kind,
                             "params/" + a.param + "/" + a.state_kind, a.dtype,
                             a.shape, std::move(c.main)));
      if (!a.pad_shape.empty()) {
        sp.pads.push_back(Add(atoms::DatasetKind::kPad, a.param, a.state_kind,
                              "params/" + a.param + "/pad/" + a.state_kind,
                              a.dtype, a.pad_shape, std::move(c.pad)));
      }
    }
    for (size_t i = 0; i < plan.opaque.size(); ++i) {
      const OpaqueBlob& b = plan.opaque[i];
      blob_of_[Add(atoms::DatasetKind::kOpaque, b.key, "", "opaque/" + b.key,
                   DType::kUInt8, Shape{static_cast<int64_t>(b.bytes.size())},
                   {})] = i;
    }
    std::stable_sort(
        params_.begin(), params_.end(),
        [](const atoms::StoredParam& a, const atoms::StoredParam& b) {
          return a.info.order != b.info.order ? a.info.order < b.info.order
                                              : a.info.fqn < b.info.fqn;
        });
    for (size_t i = 0; i < params_.size(); ++i)
      by_param_[params_[i].info.fqn] = i;
    for (const atoms::DatasetInfo& d : datasets_) {
      by_dataset_[{d.kind, d.fqn, d.state_kind}] = d.id;
    }
    for (const auto& s : plan.sources) sources_.push_back(s.get());
  }

  const fs::path& path() const noexcept override { return path_; }
  const Model& model() const noexcept override { return plan_.model; }
  std::span<const atoms::StoredParam> params() const noexcept override {
    return params_;
  }
  std::span<const atoms::DatasetInfo> datasets() const noexcept override {
    return datasets_;
  }
  const atoms::StoredParam* FindParam(std::string_view fqn) const override {
    auto it = by_param_.find(std::string(fqn));
    return it == by_param_.end() ? nullptr : &params_[it->second];
  }
  const atoms::DatasetInfo* FindAtom(std::string_view fqn,
                                     std::string_view kind) const override {
    return Find(atoms::DatasetKind::kAtom, fqn, kind);
  }
  const atoms::DatasetInfo* FindPadAtom(std::string_view fqn,
                                        std::string_view kind) const override {
    return Find(atoms::DatasetKind::kPad, fqn, kind);
  }
  const atoms::DatasetInfo* FindOpaque(std::string_view key) const override {
    return Find(atoms::DatasetKind::kOpaque, key, "");
  }

  std::string ReadBlob(const atoms::DatasetInfo& blob) const override {
    return plan_.opaque.at(blob_of_.at(blob.id)).bytes;
  }
  std::shared_ptr<const torchfile::TorchFile> OpenBlob(
      const atoms::DatasetInfo& blob) const override {
    // torch files are read through a file descriptor: park the bytes in an
    // anonymous memory file (it lives as long as the TorchFile, and no crash
    // can leave it on disk).
    const std::string& bytes = plan_.opaque.at(blob_of_.at(blob.id)).bytes;
    try {
      auto f = std::make_shared<File>(File::Anonymous("ucp-blob " + blob.fqn));
      f->WriteExact(bytes.data(), bytes.size(), 0);
      return std::make_shared<const torchfile::TorchFile>(
          torchfile::TorchFile::Open(std::move(f)));
    } catch (Error& e) {
      e.AddContext(path_.string(), " > opaque ", blob.fqn);
      throw;
    }
  }

  reshape::SourceTensor Tensor(const atoms::DatasetInfo& d) const override {
    return reshape::SourceTensor{d.id, 0, d.dtype, d.shape};
  }

  // Composes every op (which reads a box of an atom) with the atom's
  // primary fragments, so the job reads the source rank files directly.
  reshape::ExecutorStats Run(
      std::span<reshape::Job> jobs,
      const reshape::ExecutorOptions& options) const override {
    for (reshape::Job& job : jobs) {
      std::vector<reshape::CopyOp> composed;
      for (const reshape::CopyOp& op : job.tensor.ops) {
        UCP_CHECK(op.src.source < primaries_.size(), job.tensor.name,
                  ": op reads an unknown atom");
        for (const Fragment* f : primaries_[op.src.source]) {
          std::optional<Box> inter = Intersect(op.src_box, f->atom_box);
          if (!inter) continue;
          Shape to_src(inter->rank()), to_dst(inter->rank());
          for (size_t d = 0; d < inter->rank(); ++d) {
            to_src[d] = f->src_box.offset[d] - f->atom_box.offset[d];
            to_dst[d] = op.dst_box.offset[d] - op.src_box.offset[d];
          }
          composed.push_back(reshape::CopyOp{f->src, Shifted(*inter, to_src),
                                             Shifted(*inter, to_dst),
                                             op.dst_offset, op.dst_shape});
        }
      }
      job.tensor.ops = std::move(composed);
    }
    return reshape::Execute(jobs, sources_, options);
  }

 private:
  atoms::DatasetId Add(atoms::DatasetKind kind, const std::string& fqn,
                       const std::string& state_kind, std::string path,
                       DType dtype, Shape shape,
                       std::vector<const Fragment*> primaries) {
    atoms::DatasetInfo d;
    d.id = static_cast<atoms::DatasetId>(datasets_.size());
    d.kind = kind;
    d.fqn = fqn;
    d.state_kind = state_kind;
    d.path = std::move(path);
    d.dtype = dtype;
    d.shape = std::move(shape);
    d.nbytes = static_cast<uint64_t>(NumElements(d.shape)) * ElementSize(dtype);
    datasets_.push_back(std::move(d));
    primaries_.push_back(std::move(primaries));
    return datasets_.back().id;
  }

  const atoms::DatasetInfo* Find(atoms::DatasetKind kind, std::string_view fqn,
                                 std::string_view state_kind) const {
    auto it =
        by_dataset_.find({kind, std::string(fqn), std::string(state_kind)});
    return it == by_dataset_.end() ? nullptr : &datasets_[it->second];
  }

  const SourcePlan& plan_;
  fs::path path_;
  std::vector<atoms::StoredParam> params_;
  std::vector<atoms::DatasetInfo> datasets_;
  std::vector<std::vector<const Fragment*>> primaries_;  // per dataset id
  std::map<std::tuple<atoms::DatasetKind, std::string, std::string>,
           atoms::DatasetId>
      by_dataset_;
  std::map<std::string, size_t> by_param_;
  std::map<atoms::DatasetId, size_t> blob_of_;
  std::vector<const reshape::ByteSource*> sources_;
};

}  // namespace

std::unique_ptr<UniversalInput> StoreInput(
    const atoms::AtomStoreReader& store) {
  return std::make_unique<StoreInputImpl>(store);
}

std::unique_ptr<UniversalInput> PlanInput(
    const SourcePlan& plan, const std::filesystem::path& path,
    const reshape::ExecutorOptions& options, ReplicaShare share) {
  return std::make_unique<PlanInputImpl>(plan, path, options, share);
}

uint64_t MinimumTargetBytes(const UniversalInput& input, bool weights_only) {
  uint64_t total = 0;
  if (!weights_only) {
    for (const atoms::DatasetInfo& d : input.datasets()) {
      if (d.kind == atoms::DatasetKind::kAtom && d.state_kind != "param" &&
          d.state_kind != "step")
        total += d.nbytes;
    }
    return total;
  }
  // Weights only: each param at the smallest of its stored atoms.
  std::map<std::string, uint64_t> least;
  for (const atoms::DatasetInfo& d : input.datasets()) {
    if (d.kind != atoms::DatasetKind::kAtom || d.state_kind == "step") continue;
    if (d.state_kind != "param" && d.state_kind != "fp32") continue;
    auto [it, fresh] = least.emplace(d.fqn, d.nbytes);
    if (!fresh) it->second = std::min(it->second, d.nbytes);
  }
  for (const auto& [name, n] : least) total += n;
  return total;
}

}  // namespace ucp::universal
