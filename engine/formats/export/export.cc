// Consolidated export (export.h).

#include "engine/formats/export/export.h"

#include <algorithm>
#include <cctype>
#include <deque>
#include <map>
#include <memory>

#include "engine/core/convert.h"
#include "engine/core/error.h"
#include "engine/core/file.h"
#include "engine/core/progress.h"
#include "engine/formats/common/sinks.h"
#include "engine/json/json.h"
#include "engine/torchfile/torch_writer.h"

namespace ucp::exporting {
namespace {

namespace fs = std::filesystem;

struct Item {
  std::string name;
  const atoms::DatasetInfo* atom = nullptr;
  DType dtype = DType::kFloat32;  // exported
  Shape shape;
  uint64_t bytes = 0;
};

// The exported tensors in canonical order.
std::vector<Item> Collect(const universal::UniversalInput& input,
                          const ExportOptions& o, ExportSummary& summary) {
  std::vector<Item> items;
  int64_t frozen_skipped = 0;
  for (const atoms::StoredParam& p : input.params()) {
    const std::string& fqn = p.info.fqn;
    if (p.info.frozen && o.exclude_frozen) {
      ++frozen_skipped;
      continue;
    }
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
    it.name = fqn;
    it.atom = src;
    it.shape = src->shape;
    it.dtype = IsFloatingPoint(src->dtype) ? o.dtype : src->dtype;
    if (it.dtype != src->dtype && !CanConvert(src->dtype, it.dtype)) {
      throw UsageError("param ", fqn, ": cannot convert ",
                       DTypeName(src->dtype), " to ", DTypeName(it.dtype));
    }
    it.bytes =
        static_cast<uint64_t>(NumElements(it.shape)) * ElementSize(it.dtype);
    summary.total_size += it.bytes;
    items.push_back(std::move(it));
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
  reshape::CopyOp op;
  op.src = input.Tensor(*it.atom);
  op.src_box = Box::Whole(it.shape);
  op.dst_box = op.src_box;
  t.ops.push_back(std::move(op));
  return t;
}

class FileSink : public reshape::ByteSink {
 public:
  FileSink(File& file, uint64_t base) : file_(file), base_(base) {}
  void Write(uint64_t offset, std::span<const std::byte> data) override {
    file_.WriteExact(data.data(), data.size(), base_ + offset);
  }

 private:
  File& file_;
  uint64_t base_;
};

void RunJobs(const universal::UniversalInput& input,
             std::vector<reshape::Job>& jobs,
             const reshape::ExecutorOptions& executor,
             const std::string& label) {
  uint64_t total = 0;
  for (const reshape::Job& j : jobs) total += reshape::NumBytes(j.tensor);
  Progress progress(label, total);
  reshape::ExecutorOptions o = executor;
  o.progress = &progress;
  input.Run(jobs, o);
  progress.Finish();
}

void WriteSafetensors(const universal::UniversalInput& input,
                      const std::vector<Item>& items,
                      const std::vector<size_t>& shard, const fs::path& path,
                      const reshape::ExecutorOptions& executor,
                      const std::string& label) {
  std::vector<std::pair<std::string, json::Value>> members;
  json::Value meta = json::Value::Object();
  meta["format"] = "pt";
  members.emplace_back("__metadata__", std::move(meta));
  uint64_t offset = 0;
  for (size_t i : shard) {
    const Item& it = items[i];
    json::Value e = json::Value::Object();
    e["dtype"] = std::string(SafetensorsDType(it.dtype));
    json::Value shape = json::Value::Array();
    for (int64_t d : it.shape) shape.Append(d);
    e["shape"] = std::move(shape);
    json::Value offs = json::Value::Array();
    offs.Append(offset);
    offs.Append(offset + it.bytes);
    e["data_offsets"] = std::move(offs);
    members.emplace_back(it.name, std::move(e));
    offset += it.bytes;
  }
  std::string text = json::Value::FromMembers(std::move(members)).Dump();
  while (text.size() % 8 != 0) text += ' ';
  const uint64_t base = 8 + text.size();
  OutputFile out(path);
  File& f = out.file();
  f.Allocate(base + offset);
  unsigned char len[8];
  for (int i = 0; i < 8; ++i)
    len[i] = static_cast<unsigned char>((text.size() >> (8 * i)) & 0xff);
  f.WriteExact(len, 8, 0);
  f.WriteExact(text.data(), text.size(), 8);
  std::vector<reshape::Job> jobs;
  std::deque<FileSink> sinks;
  uint64_t at = base;
  for (size_t i : shard) {
    reshape::Job job;
    job.tensor = TensorOf(input, items[i]);
    sinks.emplace_back(f, at);
    job.sink = &sinks.back();
    at += items[i].bytes;
    jobs.push_back(std::move(job));
  }
  RunJobs(input, jobs, executor, label);
  out.Commit();
}

void WriteTorch(const universal::UniversalInput& input,
                const std::vector<Item>& items,
                const std::vector<size_t>& shard, const fs::path& path,
                const reshape::ExecutorOptions& executor,
                const std::string& label) {
  torchfile::TorchWriter w(path);
  pickle::Arena& a = w.arena();
  pickle::Value* root =
      a.Object(pickle::ObjectOp::kReduce,
               a.Global("collections", "OrderedDict"), a.Tuple({}));
  std::vector<reshape::Job> jobs;
  std::deque<formats::WriterSink> sinks;
  for (size_t i : shard) {
    torchfile::TensorSpec spec;
    spec.dtype = items[i].dtype;
    spec.shape = items[i].shape;
    pickle::Value* node = w.NewTensor(spec);
    root->entries.emplace_back(a.Str(items[i].name), node);
    reshape::Job job;
    job.tensor = TensorOf(input, items[i]);
    sinks.emplace_back(w, node);
    job.sink = &sinks.back();
    jobs.push_back(std::move(job));
  }
  w.Begin(root);
  RunJobs(input, jobs, executor, label);
  w.Commit();
}

}  // namespace

std::string_view SafetensorsDType(DType dtype) {
  switch (dtype) {
    case DType::kFloat64:
      return "F64";
    case DType::kFloat32:
      return "F32";
    case DType::kFloat16:
      return "F16";
    case DType::kBFloat16:
      return "BF16";
    case DType::kInt64:
      return "I64";
    case DType::kInt32:
      return "I32";
    case DType::kInt16:
      return "I16";
    case DType::kInt8:
      return "I8";
    case DType::kUInt8:
      return "U8";
    case DType::kBool:
      return "BOOL";
    case DType::kUInt16:
      return "U16";
    case DType::kUInt32:
      return "U32";
    case DType::kUInt64:
      return "U64";
    case DType::kFloat8E4M3Fn:
      return "F8_E4M3";
    case DType::kFloat8E5M2:
      return "F8_E5M2";
    default:
      throw UsageError("safetensors has no dtype for ", DTypeName(dtype),
                       " (use --format torch)");
  }
}

uint64_t ParseShardSize(std::string_view text) {
  size_t i = 0;
  uint64_t value = 0;
  while (i < text.size() && std::isdigit(static_cast<unsigned char>(text[i]))) {
    if (__builtin_mul_overflow(value, 10u, &value) ||
        __builtin_add_overflow(value, static_cast<uint64_t>(text[i] - '0'),
                               &value))
      throw UsageError("shard size too large: ", text);
    ++i;
  }
  if (i == 0) throw UsageError("not a shard size: '", text, "' (e.g. 5GB)");
  std::string unit;
  for (char c : text.substr(i))
    unit += static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  static const std::map<std::string, uint64_t> kUnits = {
      {"", 1},
      {"B", 1},
      {"KB", 1000ull},
      {"MB", 1000'000ull},
      {"GB", 1000'000'000ull},
      {"TB", 1000'000'000'000ull},
      {"KIB", 1ull << 10},
      {"MIB", 1ull << 20},
      {"GIB", 1ull << 30},
      {"TIB", 1ull << 40}};
  auto it = kUnits.find(unit);
  if (it == kUnits.end())
    throw UsageError("not a shard size: '", text, "' (e.g. 5GB, 500MB, 1GiB)");
  uint64_t out;
  if (__builtin_mul_overflow(value, it->second, &out) || out == 0)
    throw UsageError("shard size out of range: ", text);
  return out;
}

ExportSummary Export(const universal::UniversalInput& input,
                     const fs::path& out_dir, const ExportOptions& options,
                     const reshape::ExecutorOptions& executor) {
  if (!IsFloatingPoint(options.dtype) || ElementSize(options.dtype) < 2) {
    throw UsageError("export dtype ", DTypeName(options.dtype),
                     ": use fp32, bf16 or fp16");
  }
  ExportSummary summary;
  std::vector<Item> items = Collect(input, options, summary);
  summary.tensors = static_cast<int64_t>(items.size());
  const bool st = options.format == ExportFormat::kSafetensors;
  const std::string stem = st ? "model" : "pytorch_model";
  const std::string ext = st ? ".safetensors" : ".bin";
  std::vector<std::vector<size_t>> shards =
      Shards(items, options.max_shard_bytes);
  std::map<std::string, std::string> weight_map;
  for (size_t s = 0; s < shards.size(); ++s) {
    const std::string name = ShardName(stem, ext, s, shards.size());
    const std::string label =
        StrCat("exporting ", name, " (", s + 1, " of ", shards.size(), ")");
    try {
      if (st) {
        WriteSafetensors(input, items, shards[s], out_dir / name, executor,
                         label);
      } else {
        WriteTorch(input, items, shards[s], out_dir / name, executor, label);
      }
    } catch (Error& e) {
      e.AddContext("export file ", (out_dir / name).string());
      throw;
    }
    for (size_t i : shards[s]) weight_map[items[i].name] = name;
    summary.files.push_back(name);
  }
  if (shards.size() > 1) {
    json::Value index = json::Value::Object();
    index["metadata"]["total_size"] = summary.total_size;
    std::vector<std::pair<std::string, json::Value>> map;
    for (const auto& [k, v] : weight_map) map.emplace_back(k, v);  // sorted
    index["weight_map"] = json::Value::FromMembers(std::move(map));
    const std::string name = stem + ext + ".index.json";
    WriteFileAtomically(out_dir / name, index.Dump(2) + "\n");
    summary.files.push_back(name);
  }
  return summary;
}

}  // namespace ucp::exporting
