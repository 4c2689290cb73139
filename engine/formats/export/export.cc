// Consolidated export (export.h).

#include "engine/formats/export/export.h"

#include <algorithm>
#include <cctype>
#include <deque>
#include <map>
#include <memory>
#include <optional>

#include "engine/core/convert.h"
#include "engine/core/error.h"
#include "engine/core/file.h"
#include "engine/core/progress.h"
#include "engine/formats/common/safetensors.h"
#include "engine/formats/emit.h"
#include "engine/formats/exporter.h"
#include "engine/formats/names/hf_llama.h"
#include "engine/formats/target_plan.h"
#include "engine/json/json.h"

namespace ucp::exporting {
namespace {

namespace fs = std::filesystem;

struct Item {
  std::string name;
  const atoms::DatasetInfo* atom = nullptr;
  DType dtype = DType::kFloat32;  // exported
  Shape shape;
  uint64_t bytes = 0;
  /// Boxes of an atom (src; null: `atom`) and of the tensor (dst, in a view:
  /// HfPiece); empty: the whole atom.
  struct Piece {
    const atoms::DatasetInfo* atom = nullptr;
    Box src, dst;
    int64_t dst_offset = 0;
    Shape dst_shape;
  };
  std::vector<Piece> pieces;
};

// The item of tensor `name` from param `fqn`'s weights: its training-dtype
// atom when that is the export's dtype, else its fp32 master; of `shape`
// (pieces of the atom fill it), else the atom's.
Item ItemOf(const universal::UniversalInput& input, const ExportOptions& o,
            const std::string& fqn, std::string name,
            std::optional<Shape> shape = std::nullopt) {
  const atoms::DatasetInfo* fp32 = input.FindAtom(fqn, "fp32");
  const atoms::DatasetInfo* param = input.FindAtom(fqn, "param");
  const atoms::DatasetInfo* src = nullptr;
  if (param != nullptr && param->dtype == o.dtype) {
    src = param;
  } else if (fp32 != nullptr) {
    src = fp32;
  } else {
    src = param;
  }
  if (src == nullptr) {
    throw FormatError("universal input ", input.path().string(), " > param ",
                      fqn, ": neither a 'fp32' nor a 'param' atom");
  }
  Item it;
  it.name = std::move(name);
  it.atom = src;
  it.shape = shape ? std::move(*shape) : src->shape;
  it.dtype = IsFloatingPoint(src->dtype) ? o.dtype : src->dtype;
  if (it.dtype != src->dtype && !CanConvert(src->dtype, it.dtype)) {
    throw UsageError("param ", fqn, ": cannot convert ", DTypeName(src->dtype),
                     " to ", DTypeName(it.dtype));
  }
  it.bytes =
      static_cast<uint64_t>(NumElements(it.shape)) * ElementSize(it.dtype);
  return it;
}

// The exported tensors in canonical order (--hf: transformers' names and
// order, config.json into `config`).
std::vector<Item> Collect(const universal::UniversalInput& input,
                          const ExportOptions& o, ExportSummary& summary,
                          std::string& config) {
  std::vector<Item> items;
  if (o.hf) {
    names::HfModel m = names::MapToHf(input, o.hf_experts);
    ExportOptions fp32 = o;
    fp32.dtype = DType::kFloat32;
    for (names::HfTensor& t : m.tensors) {
      items.push_back(
          ItemOf(input, t.fp32 ? fp32 : o, t.param, t.name, t.shape));
      Item& it = items.back();
      for (names::HfPiece& p : t.pieces) {
        // Another param's atom (its own fp32 master or weights; converted).
        const atoms::DatasetInfo* atom = nullptr;
        if (!p.param.empty() && p.param != t.param)
          atom = ItemOf(input, t.fp32 ? fp32 : o, p.param, t.name).atom;
        it.pieces.push_back({atom, std::move(p.src), std::move(p.dst),
                             p.dst_offset, std::move(p.dst_shape)});
      }
      summary.total_size += it.bytes;
    }
    m.config["torch_dtype"] = o.dtype == DType::kBFloat16  ? "bfloat16"
                              : o.dtype == DType::kFloat16 ? "float16"
                                                           : "float32";
    config = m.config.Dump(2) + "\n";
    return items;
  }
  int64_t frozen_skipped = 0;
  for (const atoms::StoredParam& p : input.params()) {
    const std::string& fqn = p.info.fqn;
    if (p.info.frozen && o.exclude_frozen) {
      ++frozen_skipped;
      continue;
    }
    items.push_back(ItemOf(input, o, fqn, fqn));
    summary.total_size += items.back().bytes;
  }
  if (frozen_skipped > 0) {
    summary.notes.push_back(
        StrCat(frozen_skipped, " frozen params left out (--exclude-frozen)"));
  }
  return items;
}

// huggingface_hub's split: see export.h.
std::vector<std::vector<size_t>> Shards(const std::vector<Item>& items,
                                        uint64_t max) {
  std::vector<std::vector<size_t>> shards;
  std::vector<size_t> current;
  uint64_t size = 0;
  for (size_t i = 0; i < items.size(); ++i) {
    const uint64_t b = items[i].bytes;
    if (b > max) {
      shards.push_back({i});
      continue;
    }
    if (size + b > max && !current.empty()) {
      shards.push_back(std::move(current));
      current.clear();
      size = 0;
    }
    current.push_back(i);
    size += b;
  }
  if (!current.empty() || shards.empty()) shards.push_back(std::move(current));
  return shards;
}

std::string ShardName(const std::string& stem, const std::string& ext, size_t i,
                      size_t n) {
  if (n == 1) return stem + ext;
  char buf[64];
  std::snprintf(buf, sizeof buf, "-%05zu-of-%05zu", i + 1, n);
  return stem + buf + ext;
}

reshape::TargetTensor TensorOf(const universal::UniversalInput& input,
                               const Item& it) {
  reshape::TargetTensor t;
  t.name = it.name;
  t.dtype = it.dtype;
  t.shape = it.shape;
  if (it.pieces.empty()) {
    reshape::CopyOp op;
    op.src = input.Tensor(*it.atom);
    op.src_box = Box::Whole(it.shape);
    op.dst_box = op.src_box;
    t.ops.push_back(std::move(op));
  }
  for (const Item::Piece& p : it.pieces) {
    reshape::CopyOp op;
    op.src = input.Tensor(p.atom != nullptr ? *p.atom : *it.atom);
    op.src_box = p.src;
    op.dst_box = p.dst;
    op.dst_offset = p.dst_offset;
    op.dst_shape = p.dst_shape;
    t.ops.push_back(std::move(op));
  }
  return t;
}

// The safetensors header of a shard's items (formats/common/safetensors.h).
std::string SafetensorsHeader(const std::vector<Item>& items,
                              const std::vector<size_t>& shard) {
  std::vector<formats::SafetensorsTensor> tensors;
  for (size_t i : shard) {
    const Item& it = items[i];
    SafetensorsDType(it.dtype);  // the export's own refusal
    tensors.push_back({it.name, it.dtype, it.shape, 0, it.bytes});
  }
  json::Value meta = json::Value::Object();
  meta["format"] = "pt";
  return formats::SafetensorsHeader(tensors, meta);
}

// The export as a plan: one unit per shard, the index last.
class ExportPlan : public formats::TargetPlan {
 public:
  ExportPlan(const universal::UniversalInput& input, const ExportOptions& o,
             ExportSummary& summary)
      : input_(input), options_(o), summary_(summary) {
    items_ = Collect(input, o, summary, config_);
    summary.tensors = static_cast<int64_t>(items_.size());
    const bool st = o.format == ExportFormat::kSafetensors;
    stem_ = st ? "model" : "pytorch_model";
    ext_ = st ? ".safetensors" : ".bin";
    shards_ = Shards(items_, o.max_shard_bytes);
    for (size_t s = 0; s < shards_.size(); ++s)
      names_.push_back(ShardName(stem_, ext_, s, shards_.size()));
  }
  size_t units() const override {
    return shards_.size() + (shards_.size() > 1 || !config_.empty() ? 1 : 0);
  }
  std::vector<std::unique_ptr<formats::PlannedFile>> Plan(
      size_t s) const override {
    std::vector<std::unique_ptr<formats::PlannedFile>> out;
    if (s == shards_.size()) {
      // Last: the index, then config.json (a folder transformers finds
      // complete only when its config is there).
      if (shards_.size() > 1) {
        out.push_back(formats::TextFile(stem_ + ext_ + ".index.json", Index()));
        Listed(stem_ + ext_ + ".index.json");
      }
      if (!config_.empty()) {
        out.push_back(formats::TextFile("config.json", config_));
        Listed("config.json");
      }
      return out;
    }
    if (options_.format == ExportFormat::kSafetensors) {
      auto f = std::make_unique<formats::RawFile>(names_[s]);
      f->AddBytes(SafetensorsHeader(items_, shards_[s]));
      for (size_t i : shards_[s]) f->AddTensor(TensorOf(input_, items_[i]));
      out.push_back(std::move(f));
    } else {
      auto f = std::make_unique<formats::TorchSaveFile>(names_[s]);
      pickle::Arena& a = f->arena();
      pickle::Value* root =
          a.Object(pickle::ObjectOp::kReduce,
                   a.Global("collections", "OrderedDict"), a.Tuple({}));
      for (size_t i : shards_[s]) {
        root->entries.emplace_back(a.Str(items_[i].name),
                                   f->AddTensor(TensorOf(input_, items_[i])));
      }
      f->SetRoot(root);
      out.push_back(std::move(f));
    }
    Listed(names_[s]);
    return out;
  }
  formats::TargetSummary Summary() const override { return {}; }
  std::string label() const override { return "exporting"; }

 private:
  // Lists a file in the summary once (a job's processes plan twice: emit.h).
  void Listed(const std::string& name) const {
    if (std::find(summary_.files.begin(), summary_.files.end(), name) ==
        summary_.files.end())
      summary_.files.push_back(name);
  }
  // {"metadata": {"total_size"}, "weight_map": {name: file}}, keys sorted.
  std::string Index() const {
    std::map<std::string, std::string> weight_map;
    for (size_t s = 0; s < shards_.size(); ++s)
      for (size_t i : shards_[s]) weight_map[items_[i].name] = names_[s];
    json::Value index = json::Value::Object();
    index["metadata"]["total_size"] = summary_.total_size;
    std::vector<std::pair<std::string, json::Value>> map;
    for (const auto& [k, v] : weight_map) map.emplace_back(k, v);  // sorted
    index["weight_map"] = json::Value::FromMembers(std::move(map));
    return index.Dump(2) + "\n";
  }

  const universal::UniversalInput& input_;
  ExportOptions options_;
  ExportSummary& summary_;
  std::vector<Item> items_;
  std::string config_;  // config.json (--hf)
  std::string stem_, ext_;
  std::vector<std::vector<size_t>> shards_;
  std::vector<std::string> names_;
};

}  // namespace

std::string_view SafetensorsDType(DType dtype) {
  if (const auto name = formats::SafetensorsDTypeName(dtype)) return *name;
  throw UsageError("safetensors has no dtype for ", DTypeName(dtype),
                   " (use --format torch)");
}

ExportSummary Export(const universal::UniversalInput& input,
                     const fs::path& out_dir, const ExportOptions& options,
                     const reshape::ExecutorOptions& executor) {
  if (!IsFloatingPoint(options.dtype) || ElementSize(options.dtype) < 2) {
    throw UsageError("export dtype ", DTypeName(options.dtype),
                     ": use fp32, bf16 or fp16");
  }
  ExportSummary summary;
  const ExportPlan plan(input, options, summary);
  formats::EmitOptions o;
  o.executor = executor;
  formats::Emit(plan, input, out_dir, o);
  return summary;
}

namespace {

// `ucp export`'s exporter (formats/exporter.h).
class HuggingFaceExporter : public formats::Exporter {
 public:
  std::string_view Name() const override { return "huggingface"; }
  ExportSummary Export(
      const universal::UniversalInput& input, const fs::path& out_dir,
      const ExportOptions& options,
      const reshape::ExecutorOptions& executor) const override {
    return exporting::Export(input, out_dir, options, executor);
  }
};

}  // namespace

UCP_REGISTER_EXPORTER(HuggingFaceExporter);

}  // namespace ucp::exporting
