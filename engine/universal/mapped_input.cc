// Universal content under other names (mapped_input.h).

#include "engine/universal/mapped_input.h"

#include <algorithm>
#include <map>
#include <set>
#include <tuple>

#include "engine/core/error.h"

namespace ucp::universal {
namespace {

namespace fs = std::filesystem;

// Where a mapped dataset's bytes are: boxes of source datasets (src in the
// source dataset, dst in the mapped one), or a whole source dataset.
struct Part {
  const atoms::DatasetInfo* source = nullptr;
  Box src;
  Box dst;
};

class MappedInputImpl : public UniversalInput {
 public:
  MappedInputImpl(const UniversalInput& input, std::vector<MappedParam> params,
                  Model model)
      : input_(input), model_(std::move(model)) {
    std::set<std::string> frozen;
    for (size_t i = 0; i < params.size(); ++i) {
      MappedParam& m = params[i];
      Check(m);
      const atoms::StoredParam& first = *input.FindParam(m.pieces[0].param);
      m.info.dtype = first.info.dtype;
      m.info.group = first.info.group;
      m.info.frozen = first.info.frozen;
      m.info.kind = first.info.kind;
      m.info.order = static_cast<int64_t>(i);
      if (m.info.frozen) frozen.insert(m.info.fqn);
      atoms::StoredParam sp{m.info, {}, {}};
      for (const atoms::DatasetId a : first.atoms) {
        const atoms::DatasetInfo& d = input.datasets()[a];
        std::vector<Part> parts;
        if (d.shape != first.info.shape) {
          parts.push_back({&d, Box::Whole(d.shape), Box::Whole(d.shape)});
          sp.atoms.push_back(Add(atoms::DatasetKind::kAtom, m.info.fqn,
                                 d.state_kind, d.dtype, d.shape,
                                 std::move(parts)));
          continue;
        }
        for (const MappedPiece& p : m.pieces) {
          const atoms::DatasetInfo* s = input.FindAtom(p.param, d.state_kind);
          if (s == nullptr || s->dtype != d.dtype) {
            parts.clear();
            break;
          }
          parts.push_back({s, p.src, p.dst});
        }
        if (parts.empty()) continue;  // not a state of every piece's param
        sp.atoms.push_back(Add(atoms::DatasetKind::kAtom, m.info.fqn,
                               d.state_kind, d.dtype, m.info.shape,
                               std::move(parts)));
      }
      params_.push_back(std::move(sp));
    }
    for (const atoms::DatasetInfo& d : input.datasets()) {
      if (d.kind != atoms::DatasetKind::kOpaque &&
          d.kind != atoms::DatasetKind::kBuffer)
        continue;
      const atoms::DatasetId id =
          Add(d.kind, d.fqn, d.state_kind, d.dtype, d.shape,
              {{&d, Box::Whole(d.shape), Box::Whole(d.shape)}});
      datasets_[id].offset = d.offset;
      datasets_[id].nbytes = d.nbytes;
      datasets_[id].xxh3 = d.xxh3;
    }
    for (size_t i = 0; i < params_.size(); ++i)
      by_param_[params_[i].info.fqn] = i;
    for (const atoms::DatasetInfo& d : datasets_)
      by_dataset_[{d.kind, d.fqn, d.state_kind}] = d.id;
    RenameTraining(frozen);
  }

  const fs::path& path() const noexcept override { return input_.path(); }
  const Model& model() const noexcept override { return model_; }
  std::span<const atoms::StoredParam> params() const noexcept override {
    return params_;
  }
  std::span<const atoms::DatasetInfo> datasets() const noexcept override {
    return datasets_;
  }
  const atoms::StoredParam* FindParam(std::string_view fqn) const override {
    auto it = by_param_.find(fqn);
    return it == by_param_.end() ? nullptr : &params_[it->second];
  }
  const atoms::DatasetInfo* FindAtom(std::string_view fqn,
                                     std::string_view kind) const override {
    return Find(atoms::DatasetKind::kAtom, fqn, kind);
  }
  const atoms::DatasetInfo* FindPadAtom(std::string_view,
                                        std::string_view) const override {
    return nullptr;
  }
  const atoms::DatasetInfo* FindOpaque(std::string_view key) const override {
    return Find(atoms::DatasetKind::kOpaque, key, "");
  }
  std::shared_ptr<const torchfile::TorchFile> OpenBlob(
      const atoms::DatasetInfo& blob) const override {
    return input_.OpenBlob(*Whole(blob));
  }
  std::string ReadBlob(const atoms::DatasetInfo& blob) const override {
    return input_.ReadBlob(*Whole(blob));
  }
  reshape::SourceTensor Tensor(const atoms::DatasetInfo& d) const override {
    return reshape::SourceTensor{d.id, 0, d.dtype, d.shape};
  }

  // Every op reading a box of a mapped atom reads the boxes of the source
  // atoms it covers instead.
  reshape::ExecutorStats Run(
      std::span<reshape::Job> jobs,
      const reshape::ExecutorOptions& options) const override {
    for (reshape::Job& job : jobs) {
      std::vector<reshape::CopyOp> composed;
      for (const reshape::CopyOp& op : job.tensor.ops) {
        UCP_CHECK(op.src.source < parts_.size(), job.tensor.name,
                  ": op reads an unknown mapped dataset");
        for (const Part& p : parts_[op.src.source]) {
          std::optional<Box> inter = Intersect(op.src_box, p.dst);
          if (!inter) continue;
          Shape to_src(inter->rank()), to_dst(inter->rank());
          for (size_t d = 0; d < inter->rank(); ++d) {
            to_src[d] = p.src.offset[d] - p.dst.offset[d];
            to_dst[d] = op.dst_box.offset[d] - op.src_box.offset[d];
          }
          composed.push_back(reshape::CopyOp{
              input_.Tensor(*p.source), Shifted(*inter, to_src),
              Shifted(*inter, to_dst), op.dst_offset, op.dst_shape});
        }
      }
      job.tensor.ops = std::move(composed);
    }
    return input_.Run(jobs, options);
  }

 private:
  // The pieces of `m` inside their params and its shape, covering it once.
  void Check(const MappedParam& m) const {
    const std::string where = StrCat("mapped param ", m.info.fqn);
    if (m.pieces.empty()) throw UsageError(where, ": no source");
    int64_t covered = 0;
    for (size_t i = 0; i < m.pieces.size(); ++i) {
      const MappedPiece& p = m.pieces[i];
      const atoms::StoredParam* s = input_.FindParam(p.param);
      if (s == nullptr) {
        throw UsageError(where, ": ", input_.path().string(), " has no param ",
                         p.param);
      }
      if (!BoxInside(p.src, s->info.shape) || !BoxInside(p.dst, m.info.shape) ||
          p.src.size != p.dst.size) {
        throw UsageError(where, ": box ", p.src.ToString(), " of ", p.param,
                         " ", ShapeString(s->info.shape), " does not fit box ",
                         p.dst.ToString(), " of ", ShapeString(m.info.shape));
      }
      for (size_t j = 0; j < i; ++j) {
        if (Intersect(p.dst, m.pieces[j].dst)) {
          throw UsageError(where, ": pieces from ", m.pieces[j].param, " and ",
                           p.param, " overlap at ", p.dst.ToString());
        }
      }
      covered += p.dst.NumElements();
    }
    if (covered != NumElements(m.info.shape)) {
      throw UsageError(where, ": its pieces cover ", covered, " of ",
                       NumElements(m.info.shape), " elements");
    }
  }

  atoms::DatasetId Add(atoms::DatasetKind kind, const std::string& fqn,
                       const std::string& state_kind, DType dtype, Shape shape,
                       std::vector<Part> parts) {
    atoms::DatasetInfo d;
    d.id = static_cast<atoms::DatasetId>(datasets_.size());
    d.kind = kind;
    d.fqn = fqn;
    d.state_kind = state_kind;
    d.path = kind == atoms::DatasetKind::kAtom
                 ? "params/" + fqn + "/" + state_kind
                 : parts[0].source->path;
    d.dtype = dtype;
    d.shape = std::move(shape);
    d.nbytes = static_cast<uint64_t>(NumElements(d.shape)) * ElementSize(dtype);
    datasets_.push_back(std::move(d));
    parts_.push_back(std::move(parts));
    return datasets_.back().id;
  }

  const atoms::DatasetInfo* Find(atoms::DatasetKind kind, std::string_view fqn,
                                 std::string_view state_kind) const {
    auto it =
        by_dataset_.find({kind, std::string(fqn), std::string(state_kind)});
    return it == by_dataset_.end() ? nullptr : &datasets_[it->second];
  }

  // The source dataset a passed-through one (opaque, buffer) stands for.
  const atoms::DatasetInfo* Whole(const atoms::DatasetInfo& d) const {
    UCP_CHECK(d.id < parts_.size() && parts_[d.id].size() == 1,
              "not a dataset of this view: ", d.fqn);
    return parts_[d.id][0].source;
  }

  // The training record under the mapped names.
  void RenameTraining(const std::set<std::string>& frozen) {
    if (!model_.training) return;
    TrainingInfo& t = *model_.training;
    t.param_order.emplace();
    for (const atoms::StoredParam& p : params_)
      t.param_order->push_back(p.info.fqn);
    t.frozen = std::vector<std::string>(frozen.begin(), frozen.end());
    t.shared.emplace();
  }

  const UniversalInput& input_;
  Model model_;
  std::vector<atoms::StoredParam> params_;
  std::vector<atoms::DatasetInfo> datasets_;
  std::vector<std::vector<Part>> parts_;  // per dataset id
  std::map<std::tuple<atoms::DatasetKind, std::string, std::string>,
           atoms::DatasetId>
      by_dataset_;
  std::map<std::string, size_t, std::less<>> by_param_;
};

}  // namespace

MappedParam WholeParam(const atoms::StoredParam& p, std::string name) {
  MappedParam m;
  if (name == p.info.fqn) {
    m.info.rule = p.info.rule;
    m.info.tied_copies = p.info.tied_copies;
  }
  m.info.fqn = std::move(name);
  m.info.shape = p.info.shape;
  m.pieces.push_back(
      {p.info.fqn, Box::Whole(p.info.shape), Box::Whole(p.info.shape)});
  return m;
}

std::unique_ptr<UniversalInput> MappedInput(const UniversalInput& input,
                                            std::vector<MappedParam> params,
                                            Model model) {
  return std::make_unique<MappedInputImpl>(input, std::move(params),
                                           std::move(model));
}

}  // namespace ucp::universal
