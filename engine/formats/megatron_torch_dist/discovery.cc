// Finding a torch_dist checkpoint (torch_dist.h): tracker, iteration folder,
// metadata.json, the DCP container and the common state.

#include <algorithm>
#include <map>
#include <set>
#include <system_error>

#include "engine/core/error.h"
#include "engine/core/file.h"
#include "engine/formats/megatron/args.h"
#include "engine/formats/megatron/megatron_format.h"
#include "engine/formats/megatron_torch_dist/keys.h"
#include "engine/formats/megatron_torch_dist/torch_dist.h"
#include "engine/json/json.h"

namespace ucp::torch_dist {
namespace fs = std::filesystem;
using pickle::Kind;
using pickle::Value;

namespace {

// metadata.json, parsed; throws FormatError naming it.
json::Value ReadMetadataJson(const fs::path& path) {
  const std::string text = ReadSmallFile(path, 1 << 16);
  json::Value v;
  try {
    v = json::Value::Parse(text);
  } catch (Error& e) {
    throw FormatError(path.string(), ": not JSON (", e.what(), ")");
  }
  if (!v.is_object()) throw FormatError(path.string(), ": not a JSON object");
  const json::Value* backend = v.Find("sharded_backend");
  if (backend == nullptr || !backend->is_string()) {
    throw FormatError(path.string(), ": no \"sharded_backend\"");
  }
  if (backend->AsString() != "torch_dist") {
    throw FormatError(path.string(), ": sharded backend '", backend->AsString(),
                      "' (only torch_dist is read; zarr was removed in "
                      "Megatron-core 0.16: load it with an older core and "
                      "save it as torch_dist)");
  }
  return v;
}

}  // namespace

bool IsTorchDistFolder(const fs::path& dir) {
  std::error_code ec;
  const fs::path p = dir / kMetadataJson;
  if (!fs::is_regular_file(p, ec) || fs::file_size(p, ec) > (1 << 16))
    return false;
  try {
    ReadMetadataJson(p);
    return true;
  } catch (const Error&) {
    return false;
  }
}

bool HoldsTorchDistFiles(const fs::path& iter_dir) {
  std::error_code ec;
  return fs::exists(iter_dir / kMetadataJson, ec) ||
         fs::exists(iter_dir / dcp::kMetadataFile, ec) ||
         fs::exists(iter_dir / "__0_0.distcp", ec);
}

Checkpoint Discover(const fs::path& path, std::optional<int64_t> iteration) {
  std::error_code ec;
  Checkpoint c;
  megatron::IterationFolder f = megatron::LocateIteration(
      path, iteration, megatron::ReleaseFolder::kAccepted);
  c.dir = std::move(f.dir);
  c.iter_dir = std::move(f.iter_dir);
  c.iteration = f.iteration;
  c.release = f.release;
  const fs::path mj = c.iter_dir / kMetadataJson;
  if (!fs::exists(mj, ec)) {
    throw FormatError(c.iter_dir.string(),
                      ": no metadata.json: an incomplete torch_dist checkpoint "
                      "(Megatron writes it last, once every rank has saved)");
  }
  ReadMetadataJson(mj);
  c.dcp = dcp::Discover(c.iter_dir, "");
  c.files = c.dcp.files;
  c.files.push_back(mj);

  // The common state: common.pt, else the common_state item.
  const fs::path common = c.iter_dir / kCommonFile;
  if (fs::exists(common, ec)) {
    c.common_file = std::make_shared<const torchfile::TorchFile>(
        torchfile::TorchFile::Open(common));
    c.common = c.common_file->root();
    c.common_in = kCommonFile;
    c.files.push_back(common);
    if (c.common == nullptr || !c.common->IsDictLike()) {
      throw FormatError(common.string(), ": not a dict");
    }
  } else {
    for (const auto& [key, items] : c.dcp.items) {
      if (key.offset || !key.fqn.starts_with(kCommonStatePrefix) ||
          items.empty())
        continue;
      dcp::FileCache files;
      c.common_file = dcp::OpenItem(items.front(), key, files);
      const Value* root = c.common_file->root();
      if (root != nullptr &&
          (root->kind == Kind::kList || root->kind == Kind::kTuple) &&
          root->items.size() == 1)
        root = root->items[0];
      if (root == nullptr || !root->IsDictLike()) {
        throw FormatError(items.front().file.string(), " > ", key.fqn,
                          ": the common state is not a dict");
      }
      c.common = root;
      c.common_in = "common_state";
      break;
    }
  }
  if (const Value* cm = pickle::DictGet(c.common, "content_metadata");
      cm != nullptr && cm->IsDictLike())
    c.content_metadata = megatron::ValueToJson(cm);

  // The optimizer's format. fully_sharded_model_space (core <= 0.14) and
  // the non-distributed optimizer share key names: the former's N-D keys
  // are flattened, one dim more than their model key's.
  bool state = false, fp32_param = false, buckets = false, flattened = false;
  std::map<std::string_view, const Shape*> model_shape;
  for (const dcp::Entry& e : c.dcp.metadata.entries)
    if (e.tensor) model_shape.emplace(e.fqn, &e.size);
  // dp_zero_gather_scatter: an object per model-parallel group.
  bool zero = false;
  for (const dcp::Entry& e : c.dcp.metadata.entries) {
    const KeyInfo k = ClassifyKey(e.fqn, e.tensor);
    if (k.kind == KeyInfo::kBucket) buckets = true;
    if (k.kind == KeyInfo::kObject &&
        k.model_key.starts_with("optimizer.distributed.dp_group_idx_") &&
        k.model_key.ends_with(".param_state"))
      zero = true;
    if (k.kind == KeyInfo::kOptimizerState) {
      state = true;
      fp32_param = fp32_param || k.state == "fp32_param";
      auto m = model_shape.find(k.model_key);
      flattened = flattened || (m != model_shape.end() &&
                                IsFlattenedState(e.size, *m->second));
    }
  }
  if (const json::Value* t =
          c.content_metadata.Find("distrib_optim_sharding_type");
      t != nullptr && t->is_string() && (state || buckets || zero)) {
    c.optimizer = t->AsString();
  } else if (zero) {
    c.optimizer = "dp_zero_gather_scatter";
  } else if (buckets) {
    c.optimizer = "dp_reshardable";
  } else if (fp32_param) {
    c.optimizer = "non_distributed";
  } else if (state) {
    c.optimizer = "fully_reshardable";
  } else {
    c.optimizer = "none";
  }
  if (state && !buckets && fp32_param &&
      c.optimizer != "fully_sharded_model_space")
    c.optimizer = flattened ? "fully_sharded_model_space" : "non_distributed";

  // The topology: args, else TP x PP of the rng states' grid.
  if (const Value* args = pickle::DictGet(c.common, "args")) {
    const megatron::RunConfig run = megatron::ReadRunConfig(
        megatron::ArgsView(
            args, StrCat(c.iter_dir.string(), " > ", c.common_in, " > args")),
        /*experts=*/true);
    c.topology = run.topology;
  } else {
    for (const dcp::Entry& e : c.dcp.metadata.entries) {
      const KeyInfo k = ClassifyKey(e.fqn, e.tensor);
      if (k.kind == KeyInfo::kObject && k.model_key == "rng_state" &&
          k.grid.size() == 2) {
        c.topology.pp = k.grid[0];
        c.topology.tp = k.grid[1];
        break;
      }
    }
    c.topology.dp =
        std::max<int64_t>(1, c.dcp.world / (c.topology.tp * c.topology.pp));
  }
  return c;
}

}  // namespace ucp::torch_dist
