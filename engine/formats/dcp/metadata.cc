#include "engine/formats/dcp/metadata.h"

#include <set>

#include "engine/core/error.h"
#include "engine/pickle/pickle.h"
#include "engine/pickle/text.h"

namespace ucp::dcp {
namespace {

using pickle::Kind;
using pickle::ObjectOp;
using pickle::Value;

constexpr std::string_view kMeta = "torch.distributed.checkpoint.metadata";

// The globals a .metadata may name (module, names); "*" any dtype name.
struct Allowed {
  std::string_view module;
  std::vector<std::string_view> names;
};
const std::vector<Allowed>& AllowedGlobals() {
  static const std::vector<Allowed> a = {
      {kMeta,
       {"Metadata", "TensorStorageMetadata", "ChunkStorageMetadata",
        "BytesStorageMetadata", "MetadataIndex", "TensorProperties",
        "_MEM_FORMAT_ENCODING", "MEM_FORMAT_ENCODING", "StorageMeta"}},
      {"torch.distributed._shard.sharded_tensor.metadata",
       {"TensorProperties", "MEM_FORMAT_ENCODING"}},
      {"torch.distributed.checkpoint.filesystem",
       {"_StorageInfo", "_StoragePrefix"}},
      {"torch.distributed.checkpoint.planner",
       {"SavePlan", "WriteItem", "WriteItemType", "TensorWriteData"}},
      {"megatron.core.dist_checkpointing.strategies.torch",
       {"MCoreMetadata", "MCoreSavePlan"}},
      {"bytecheckpoint.checkpointer.meta_type", {"Metadata", "_StorageInfo"}},
      {"torch.serialization", {"_get_layout"}},
      {"pathlib",
       {"Path", "PosixPath", "WindowsPath", "PurePosixPath",
        "PureWindowsPath"}},
      {"pathlib._local",
       {"Path", "PosixPath", "WindowsPath", "PurePosixPath",
        "PureWindowsPath"}},
      {"collections", {"OrderedDict"}},
      {"builtins", {"set", "frozenset", "object", "getattr"}},
      {"copyreg", {"_reconstructor"}},
  };
  return a;
}

bool IsAllowed(const Value& g) {
  if (g.module == "torch") {
    return g.name == "Size" || DTypeFromName(g.name).has_value();
  }
  for (const Allowed& a : AllowedGlobals()) {
    for (std::string_view n : a.names)
      if (g.IsGlobal(a.module, n)) return true;
  }
  return false;
}

// The class name without its module: "Metadata" for MCoreMetadata and
// ByteCheckpoint's, "" for what is not an object of a global class.
std::string BaseClass(const Value* v) {
  if (v == nullptr || v->kind != Kind::kObject) return "";
  std::string n = v->ClassName();
  const size_t dot = n.rfind('.');
  if (dot != std::string::npos) n = n.substr(dot + 1);
  if (n == "MCoreMetadata") return "Metadata";
  if (n == "MCoreSavePlan") return "SavePlan";
  return n;
}

const Value* Field(const Value* obj, std::string_view name,
                   const std::string& where) {
  const Value* v = obj != nullptr ? obj->Attr(name) : nullptr;
  if (v == nullptr) throw FormatError(where, ": no '", name, "'");
  return v;
}

std::string Str(const Value* v, const std::string& where) {
  if (v == nullptr || v->kind != Kind::kStr)
    throw FormatError(where, ": not a str");
  return v->s;
}

int64_t Int(const Value* v, const std::string& where) {
  std::optional<int64_t> i = v != nullptr ? v->AsInt() : std::nullopt;
  if (!i) throw FormatError(where, ": not an int");
  return *i;
}

// torch.Size((d, ...)) or a plain tuple / list of ints.
Shape SizeOf(const Value* v, const std::string& where) {
  if (v != nullptr && v->kind == Kind::kObject && v->callable != nullptr &&
      v->callable->IsGlobal("torch", "Size") && v->args != nullptr &&
      v->args->items.size() == 1) {
    v = v->args->items[0];
  }
  if (v == nullptr || (v->kind != Kind::kTuple && v->kind != Kind::kList)) {
    throw FormatError(where, ": not a torch.Size");
  }
  Shape s;
  for (const Value* d : v->items) {
    const int64_t x = Int(d, where);
    if (x < 0) throw FormatError(where, ": negative size ", x);
    s.push_back(x);
  }
  return s;
}

DType DTypeOf(const Value* v, const std::string& where) {
  if (v == nullptr || v->kind != Kind::kGlobal || v->module != "torch") {
    throw FormatError(where, ": dtype is not a torch dtype");
  }
  std::optional<DType> d = DTypeFromName(v->name);
  if (!d) throw FormatError(where, ": unknown dtype torch.", v->name);
  return *d;
}

Entry ParseEntry(const std::string& fqn, const Value* v,
                 const std::string& where) {
  Entry e;
  e.fqn = fqn;
  const std::string cls = BaseClass(v);
  if (cls == "BytesStorageMetadata") return e;
  if (cls != "TensorStorageMetadata") {
    throw FormatError(where, ": a ", v != nullptr ? v->ClassName() : "None",
                      ", not a Tensor/BytesStorageMetadata");
  }
  e.tensor = true;
  const Value* props = Field(v, "properties", where);
  const Value* st = props->state;
  if (st != nullptr && st->kind == Kind::kTuple && !st->items.empty()) {
    e.dtype = DTypeOf(st->items[0], where + " > properties");
    if (st->items.size() > 2 && st->items[2]->kind == Kind::kBool)
      e.requires_grad = st->items[2]->b;
  } else {
    e.dtype = DTypeOf(Field(props, "dtype", where + " > properties"),
                      where + " > properties");
  }
  e.size = SizeOf(Field(v, "size", where), where + " > size");
  const Value* chunks = Field(v, "chunks", where);
  if (chunks->kind != Kind::kList && chunks->kind != Kind::kTuple)
    throw FormatError(where, " > chunks: not a list");
  for (const Value* c : chunks->items) {
    const std::string cw = where + " > chunk";
    if (BaseClass(c) != "ChunkStorageMetadata")
      throw FormatError(cw, ": not a ChunkStorageMetadata");
    Chunk k;
    k.offsets = SizeOf(Field(c, "offsets", cw), cw + " > offsets");
    k.sizes = SizeOf(Field(c, "sizes", cw), cw + " > sizes");
    if (k.offsets.size() != k.sizes.size()) {
      throw FormatError(cw, ": ", k.offsets.size(), " offsets but ",
                        k.sizes.size(), " sizes");
    }
    e.chunks.push_back(std::move(k));
  }
  return e;
}

}  // namespace

const Entry* Metadata::Find(std::string_view fqn) const {
  for (const Entry& e : entries)
    if (e.fqn == fqn) return &e;
  return nullptr;
}

std::string BoxString(const Chunk& c) {
  std::string s = "offsets [";
  for (size_t i = 0; i < c.offsets.size(); ++i)
    s += StrCat(i ? ", " : "", c.offsets[i]);
  s += "] sizes [";
  for (size_t i = 0; i < c.sizes.size(); ++i)
    s += StrCat(i ? ", " : "", c.sizes[i]);
  return s + "]";
}

Metadata ParseMetadata(std::string_view bytes,
                       const std::filesystem::path& path) {
  const std::string where = path.string();
  Metadata m;
  pickle::Arena arena;  // the parsed graph, dropped on return
  const Value* root;
  try {
    root = pickle::Unpickle(bytes, arena);
  } catch (Error& e) {
    e.AddContext(where);
    throw;
  }
  for (const Value& v : arena.nodes()) {
    if (v.kind == Kind::kGlobal && !IsAllowed(v)) {
      throw FormatError(where, ": unknown global ", v.module, ".", v.name,
                        " (not a DCP metadata class; nothing is executed)");
    }
    // Enum members (Python >= 3.11): getattr(<one of the classes>, name).
    if (v.kind == Kind::kObject && v.callable != nullptr &&
        v.callable->IsGlobal("builtins", "getattr") &&
        (v.args == nullptr || v.args->items.size() != 2 ||
         v.args->items[0]->kind != Kind::kGlobal ||
         v.args->items[1]->kind != Kind::kStr)) {
      throw FormatError(where,
                        ": builtins.getattr applied to something other than "
                        "a class and a name");
    }
  }
  if (BaseClass(root) != "Metadata") {
    throw FormatError(where, ": not a DCP Metadata object (a ",
                      root != nullptr ? pickle::Repr(root, 60) : "None", ")");
  }
  const Value* state = root->state;
  if (state == nullptr || !state->IsDictLike())
    throw FormatError(where, ": Metadata without attributes");
  static const std::set<std::string> kKnown = {"state_dict_metadata",
                                               "planner_data", "storage_data",
                                               "storage_meta", "version"};
  for (const auto& [k, v] : state->entries) {
    if (k == nullptr || k->kind != Kind::kStr)
      throw FormatError(where, ": Metadata attribute that is not a str");
    if (k->s == "version" && v != nullptr && v->kind == Kind::kStr)
      m.version = v->s;
    if (!kKnown.count(k->s))
      m.extra.emplace_back(k->s, v != nullptr ? pickle::Pickle(v) : "");
  }
  const Value* sdm = state->Get("state_dict_metadata");
  if (sdm == nullptr || !sdm->IsDictLike())
    throw FormatError(where, ": no state_dict_metadata dict");
  std::set<std::string> seen;
  for (const auto& [k, v] : sdm->entries) {
    const std::string fqn = Str(k, where + " > state_dict_metadata key");
    if (!seen.insert(fqn).second)
      throw FormatError(where, ": key ", fqn, " twice");
    m.entries.push_back(ParseEntry(fqn, v, where + " > " + fqn));
  }
  if (const Value* pd = state->Get("planner_data");
      pd != nullptr && pd->IsDictLike()) {
    for (const auto& [k, v] : pd->entries) {
      if (k == nullptr || k->kind != Kind::kStr || v == nullptr ||
          (v->kind != Kind::kTuple && v->kind != Kind::kList))
        continue;
      std::vector<PathComponent> path_components;
      bool ok = true;
      for (const Value* c : v->items) {
        if (c->kind == Kind::kStr) {
          path_components.emplace_back(c->s);
        } else if (std::optional<int64_t> i = c->AsInt();
                   i && c->kind == Kind::kInt) {
          path_components.emplace_back(*i);
        } else {
          ok = false;
        }
      }
      if (ok) m.planner_data.emplace_back(k->s, std::move(path_components));
    }
  }
  const Value* sd = state->Get("storage_data");
  if (sd == nullptr || !sd->IsDictLike())
    throw FormatError(where,
                      ": no storage_data dict (not a FileSystemWriter "
                      "checkpoint?)");
  for (const auto& [k, v] : sd->entries) {
    const std::string kw = where + " > storage_data";
    if (BaseClass(k) != "MetadataIndex")
      throw FormatError(kw, ": key is not a MetadataIndex");
    ItemKey key;
    key.fqn = Str(Field(k, "fqn", kw), kw + " > fqn");
    const Value* off = k->Attr("offset");
    if (off != nullptr && off->kind != Kind::kNone)
      key.offset = SizeOf(off, kw + " > " + key.fqn + " > offset");
    const std::string vw = kw + " > " + key.fqn;
    if (BaseClass(v) != "_StorageInfo")
      throw FormatError(vw, ": not a _StorageInfo");
    StorageInfo info;
    info.relative_path = Str(Field(v, "relative_path", vw), vw);
    const int64_t offset = Int(Field(v, "offset", vw), vw + " > offset");
    const int64_t length = Int(Field(v, "length", vw), vw + " > length");
    if (offset < 0 || length < 0)
      throw FormatError(vw, ": negative offset or length");
    info.offset = static_cast<uint64_t>(offset);
    info.length = static_cast<uint64_t>(length);
    if (const Value* t = v->Attr("transform_descriptors");
        t != nullptr && t->kind != Kind::kNone) {
      if (t->kind != Kind::kList && t->kind != Kind::kTuple)
        throw FormatError(vw, " > transform_descriptors: not a list");
      for (const Value* d : t->items) info.transforms.push_back(Str(d, vw));
    }
    if (info.relative_path.empty() ||
        info.relative_path.find('/') != std::string::npos ||
        info.relative_path == "." || info.relative_path == "..") {
      throw FormatError(vw, ": relative_path '", info.relative_path,
                        "' is not a file name of the checkpoint folder");
    }
    m.storage[std::move(key)] = std::move(info);
  }
  return m;
}

std::string PickleMetadata(const Metadata& m, const std::string& save_id) {
  pickle::Arena a;
  auto obj = [&](std::string_view module, std::string_view name, Value* state) {
    Value* o =
        a.Object(ObjectOp::kNewObj,
                 a.Global(std::string(module), std::string(name)), a.Tuple({}));
    o->state = state;
    return o;
  };
  auto size = [&](const Shape& s) {
    std::vector<Value*> dims;
    for (int64_t d : s) dims.push_back(a.Int(d));
    return a.Object(ObjectOp::kReduce, a.Global("torch", "Size"),
                    a.Tuple({a.Tuple(std::move(dims))}));
  };
  Value* sdm = a.Dict();
  for (const Entry& e : m.entries) {
    Value* v;
    if (!e.tensor) {
      v = obj(kMeta, "BytesStorageMetadata", nullptr);
    } else {
      Value* layout = a.Object(ObjectOp::kReduce,
                               a.Global("torch.serialization", "_get_layout"),
                               a.Tuple({a.Str("torch.strided")}));
      Value* mem =
          a.Object(ObjectOp::kReduce,
                   a.Global(std::string(kMeta), "_MEM_FORMAT_ENCODING"),
                   a.Tuple({a.Int(0)}));
      Value* props =
          obj(kMeta, "TensorProperties",
              a.Tuple({a.Global("torch", std::string(DTypeName(e.dtype))),
                       layout, a.Bool(e.requires_grad), mem, a.Bool(false)}));
      std::vector<Value*> chunks;
      for (const Chunk& c : e.chunks) {
        chunks.push_back(obj(kMeta, "ChunkStorageMetadata",
                             a.Dict({{a.Str("offsets"), size(c.offsets)},
                                     {a.Str("sizes"), size(c.sizes)}})));
      }
      v = obj(kMeta, "TensorStorageMetadata",
              a.Dict({{a.Str("properties"), props},
                      {a.Str("size"), size(e.size)},
                      {a.Str("chunks"), a.List(std::move(chunks))}}));
    }
    sdm->entries.emplace_back(a.Str(e.fqn), v);
  }
  Value* pd = a.Dict();
  for (const auto& [fqn, path] : m.planner_data) {
    std::vector<Value*> items;
    for (const PathComponent& c : path) {
      items.push_back(std::holds_alternative<std::string>(c)
                          ? a.Str(std::get<std::string>(c))
                          : a.Int(std::get<int64_t>(c)));
    }
    pd->entries.emplace_back(a.Str(fqn), a.Tuple(std::move(items)));
  }
  // storage_data in the order of the entries and their chunks (the items'
  // index hint is the chunk's position), bytes items first.
  Value* sd = a.Dict();
  std::set<ItemKey> written;
  auto add_item = [&](const ItemKey& key, int64_t index) {
    auto it = m.storage.find(key);
    if (it == m.storage.end() || !written.insert(key).second) return;
    const StorageInfo& s = it->second;
    Value* k = obj(kMeta, "MetadataIndex",
                   key.offset ? a.Dict({{a.Str("fqn"), a.Str(key.fqn)},
                                        {a.Str("index"), a.Int(index)},
                                        {a.Str("offset"), size(*key.offset)}})
                              : a.Dict({{a.Str("fqn"), a.Str(key.fqn)},
                                        {a.Str("index"), a.None()}}));
    Value* info =
        a.Dict({{a.Str("relative_path"), a.Str(s.relative_path)},
                {a.Str("offset"), a.Int(static_cast<int64_t>(s.offset))},
                {a.Str("length"), a.Int(static_cast<int64_t>(s.length))}});
    if (!s.transforms.empty()) {
      std::vector<Value*> t;
      for (const std::string& x : s.transforms) t.push_back(a.Str(x));
      info->entries.emplace_back(a.Str("transform_descriptors"),
                                 a.List(std::move(t)));
    }
    sd->entries.emplace_back(k, obj("torch.distributed.checkpoint.filesystem",
                                    "_StorageInfo", info));
  };
  for (const Entry& e : m.entries)
    if (!e.tensor) add_item({e.fqn, std::nullopt}, 0);
  for (const Entry& e : m.entries) {
    if (!e.tensor) continue;
    for (size_t i = 0; i < e.chunks.size(); ++i)
      add_item({e.fqn, e.chunks[i].offsets}, static_cast<int64_t>(i));
  }
  // Items no entry names (torch's loader ignores them): kept, last.
  for (const auto& [key, info] : m.storage) add_item(key, 0);
  Value* storage_meta = obj(kMeta, "StorageMeta",
                            a.Dict({{a.Str("checkpoint_id"), a.None()},
                                    {a.Str("save_id"), a.Str(save_id)},
                                    {a.Str("load_id"), a.None()},
                                    {a.Str("modules"), a.List({})}}));
  Value* state = a.Dict({{a.Str("state_dict_metadata"), sdm},
                         {a.Str("planner_data"), pd},
                         {a.Str("storage_data"), sd},
                         {a.Str("storage_meta"), storage_meta},
                         {a.Str("version"), a.Str("1.0.0")}});
  for (const auto& [name, bytes] : m.extra)
    state->entries.emplace_back(
        a.Str(name), bytes.empty() ? a.None() : pickle::Unpickle(bytes, a));
  return pickle::Pickle(obj(kMeta, "Metadata", state));
}

}  // namespace ucp::dcp
