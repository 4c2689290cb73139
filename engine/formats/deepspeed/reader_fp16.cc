// Reading ZeRO 0 with fp16 training: FP16_Optimizer (flat fp32 groups) and
// FP16_UnfusedOptimizer (an fp32 master per param) in the model states,
// each master matched to its module param (deepspeed_format.h).

#include <algorithm>
#include <map>
#include <memory>
#include <set>

#include "engine/core/convert.h"
#include "engine/core/error.h"
#include "engine/formats/deepspeed/deepspeed.h"
#include "engine/formats/deepspeed/flat_layout.h"
#include "engine/formats/deepspeed/pickled.h"
#include "engine/formats/deepspeed/reader.h"

namespace ucp::deepspeed::internal {

namespace fs = std::filesystem;
using pickle::Kind;
using pickle::Value;
using torchfile::TensorInfo;
using torchfile::TorchFile;

int64_t Planner::MatchMaster(const FilePtr& f, const TensorInfo& master,
                             int64_t elem, int64_t room, const Shape* shape,
                             size_t hint, const std::vector<bool>& taken) {
  // Compared: the first and the last kSample elements of each param (two
  // ranges, one read each).
  static constexpr int64_t kSample = 16;
  auto ranges = [](int64_t n) {
    const int64_t head = std::min(n, kSample);
    const int64_t tail_begin = std::max(head, n - kSample);
    return std::array<std::pair<int64_t, int64_t>, 2>{
        {{0, head}, {tail_begin, n - tail_begin}}};
  };
  auto read = [](const TorchFile& file, const TensorInfo& t, int64_t begin,
                 int64_t count, void* dst) {
    if (count == 0) return;
    file.ReadTensorRange(t, begin, count,
                         std::span<std::byte>(static_cast<std::byte*>(dst),
                                              static_cast<size_t>(count) *
                                                  ElementSize(t.dtype)));
  };
  const int64_t head = std::min(room, kSample);
  std::vector<float> master_head(static_cast<size_t>(head));
  read(*f, master, elem, head, master_head.data());
  const size_t n = params_.size();
  for (size_t k = 0; k < n; ++k) {
    const size_t i = (hint + k) % n;
    const Param& p = params_[i];
    if (p.buffer || taken[i]) continue;
    const int64_t numel = NumElements(p.shape);
    if (shape != nullptr ? p.shape != *shape : (numel == 0 || numel > room))
      continue;
    const auto [h, tail] = ranges(numel);
    auto it = lp_samples_.find(i);
    if (it == lp_samples_.end()) {
      const Entry* e = FindEntry(p.name);
      const TensorInfo* t =
          e != nullptr ? e->file->FindTensor(e->value) : nullptr;
      std::vector<uint16_t> bits;
      if (t != nullptr && ElementSize(t->dtype) == 2 && t->contiguous &&
          t->numel == numel) {
        bits.resize(static_cast<size_t>(h.second + tail.second));
        read(*e->file, *t, 0, h.second, bits.data());
        read(*e->file, *t, tail.first, tail.second, bits.data() + h.second);
      }
      it = lp_samples_.emplace(i, std::move(bits)).first;
    }
    const std::vector<uint16_t>& lp_bits = it->second;
    if (lp_bits.size() != static_cast<size_t>(h.second + tail.second)) continue;
    const bool bf16 = p.dtype == DType::kBFloat16;
    auto same = [&](const float* x, const uint16_t* bits, int64_t count) {
      for (int64_t j = 0; j < count; ++j) {
        if ((bf16 ? Float32ToBFloat16(x[j]) : Float32ToFloat16(x[j])) !=
            bits[j])
          return false;
      }
      return true;
    };
    if (!same(master_head.data(), lp_bits.data(), h.second)) continue;
    std::vector<float> master_tail(static_cast<size_t>(tail.second));
    read(*f, master, elem + tail.first, tail.second, master_tail.data());
    if (same(master_tail.data(), lp_bits.data() + h.second, tail.second))
      return static_cast<int64_t>(i);
  }
  return -1;
}

void Planner::PlanFp16Optimizer() {
  const FilePtr& f = models_[0];
  const Value* opt = Get(model_, "optimizer");
  const bool flat = fp16_ == Fp16::kFlat;
  const std::string where0 =
      StrCat("rank file ", c_.model_files[0].string(), " > optimizer");
  try {
    const Value* inner = Require(opt, "optimizer_state_dict");
    const Value* state = RequireDict(inner, "state");
    const auto& pgroups = Items(Require(inner, "param_groups"), "param_groups");
    const char* key = flat ? "fp32_groups_flat" : "fp32_groups";
    const auto& masters = Items(Require(opt, key), key);
    if (masters.size() != pgroups.size()) {
      throw FormatError(masters.size(), " groups in ", key, " but ",
                        pgroups.size(), " param groups");
    }
    // Neither wrapper records which params a group holds: each master
    // slice is matched to the trainable param whose stored fp16 weights are
    // that slice rounded (DeepSpeed copies the masters into the fp16 params
    // after every step), preferring module order.
    std::vector<bool> taken(params_.size(), false);
    groups_.assign(pgroups.size(), {});
    for (size_t g = 0; g < pgroups.size(); ++g) {
      // Groups are the module's params filtered (weight decay or not, ...):
      // the search starts at the module's first param and goes on after
      // each match, so params whose fp16 weights are equal (layer norms
      // early in training) are taken in module order.
      size_t hint = 0;
      group_dicts_.push_back(pgroups[g]);
      const std::string gw = StrCat(where0, " > ", key, "[", g, "]");
      const auto& ids = Items(Require(pgroups[g], "params"), "params");
      std::vector<const Value*> tensors;
      if (flat) {
        tensors.push_back(masters[g]);
      } else {
        for (const Value* v : Items(masters[g], key)) tensors.push_back(v);
      }
      if (ids.size() != tensors.size()) {
        throw FormatError("param_groups[", g, "] lists ", ids.size(),
                          " params but ", key, "[", g, "] holds ",
                          tensors.size(), " tensors");
      }
      for (size_t j = 0; j < tensors.size(); ++j) {
        const std::string tw = flat ? gw : StrCat(gw, "[", j, "]");
        const TensorInfo& mt = TensorAt(f, tensors[j], tw);
        if (mt.dtype != DType::kFloat32) {
          throw FormatError(tw, ": ", DTypeName(mt.dtype),
                            ", expected float32 master weights");
        }
        const reshape::SourceTensor msrc =
            reshape::FlatView(Tensor(f, mt, tw), 0, {mt.numel}, tw);
        const int64_t id = Int(ids[j], "param id");
        const Value* st = GetIndex(state, id);
        const std::string sw =
            StrCat(where0, " > optimizer_state_dict > state[", id, "]");
        std::vector<std::pair<std::string, reshape::SourceTensor>> kinds;
        if (st != nullptr) {
          for (const std::string& k : Keys(st, "state")) {
            if (k == "step") continue;
            const TensorInfo& t = TensorAt(f, Get(st, k), sw + " > " + k);
            if (t.numel != mt.numel || t.dtype != DType::kFloat32) {
              throw FormatError(sw, " > ", k, ": ", t.numel, " ",
                                DTypeName(t.dtype), " elements, expected ",
                                mt.numel, " float32");
            }
            const reshape::SourceTensor src = reshape::FlatView(
                Tensor(f, t, sw + " > " + k), 0, {t.numel}, sw + " > " + k);
            kinds.emplace_back(k, src);
            state_kinds_.insert(k);
          }
        }
        int64_t o = 0;
        do {
          const int64_t i = MatchMaster(
              f, mt, o, mt.numel - o, flat ? nullptr : &mt.shape, hint, taken);
          if (i < 0) {
            throw FormatError(
                tw,
                ": no trainable module param matches the fp32 master "
                "weights at element ",
                o, " of ", mt.numel,
                " (an fp16 module weight is its master rounded; is the module "
                "from another step?)");
          }
          Param& p = params_[static_cast<size_t>(i)];
          taken[static_cast<size_t>(i)] = true;
          hint = static_cast<size_t>(i) + 1;
          p.group = static_cast<int64_t>(g);
          groups_[g].push_back(p.name);
          const int64_t n = NumElements(p.shape);
          try {
            AddFlat(Atom(p, "fp32", DType::kFloat32, false), p, msrc, o, 0, n,
                    tw);
            for (const auto& [k, src] : kinds)
              AddFlat(Atom(p, k, DType::kFloat32, false), p, src, o, 0, n,
                      sw + " > " + k);
            if (st != nullptr) PlanStep(p, f, st, sw);
          } catch (Error& e2) {
            e2.AddContext("param ", p.name);
            throw;
          }
          o += n;
        } while (o < mt.numel);
      }
    }
    MarkFrozen(taken);
  } catch (Error& e) {
    AddContextOnce(e, where0);
    throw;
  }
}

}  // namespace ucp::deepspeed::internal
