#include "engine/universal/model.h"

#include <utility>

#include "engine/atoms/atom_store.h"
#include "engine/core/error.h"
#include "engine/json/json.h"
#include "engine/universal/extras.h"

namespace ucp::universal {

namespace {

using json::Value;

Value ParseObject(const std::string& text) {
  if (text.empty()) return Value::Object();
  Value v = Value::Parse(text);
  if (!v.is_object()) throw FormatError("not a JSON object");
  return v;
}

// The attribute's object, each member bound by `bind` (which reads through
// a RecordReader, extras.h); errors get the file and attribute as context.
template <typename F>
void ReadAttr(const std::string& text, const char* attr,
              const std::filesystem::path& file, F&& bind) {
  const std::string context =
      StrCat("universal file ", file.string(), " > attribute ", attr);
  Value object;
  try {
    object = ParseObject(text);
  } catch (Error& e) {
    e.AddContext(context);
    throw;
  }
  RecordReader r(object, context);
  bind(object, r);
}

template <typename T>
void Put(Value& out, const char* key, const std::optional<T>& v) {
  if (v) out[key] = *v;
}

void PutStrings(Value& out, const char* key,
                const std::optional<std::vector<std::string>>& v) {
  if (!v) return;
  Value a = Value::Array();
  for (const std::string& s : *v) a.Append(s);
  out[key] = std::move(a);
}

Value NumberValue(double x, bool as_int) {
  return as_int ? Value(static_cast<int64_t>(x)) : Value(x);
}

SourceInfo ReadSource(const std::string& text,
                      const std::filesystem::path& file) {
  SourceInfo s;
  ReadAttr(text, "source", file, [&](const Value&, RecordReader& r) {
    r.Get("framework", s.framework);
    r.Get("framework_version", s.framework_version);
    r.Get("format", s.format);
    r.Get("driver", s.driver);
    r.Get("tp", s.tp);
    r.Get("pp", s.pp);
    r.Get("vpp", s.vpp);
    r.Get("dp", s.dp);
    r.Get("cp", s.cp);
    r.Get("ep", s.ep);
    r.Get("zero_stage", s.zero_stage);
    r.Get("world", s.world);
    r.Get("first_stage_layers", s.first_stage_layers);
    r.Get("last_stage_layers", s.last_stage_layers);
    r.Get("distributed_optimizer", s.distributed_optimizer);
    r.Get("padded_vocab_size", s.padded_vocab_size);
    r.Get("dtype", s.dtype);
    r.Get("dtypes", s.dtypes);
    r.Get("layout", s.layout);
    r.Get("names", s.names);
    s.other = r.Rest();
  });
  return s;
}

Value WriteSource(const SourceInfo& s) {
  Value o = Value::Object();
  Put(o, "framework", s.framework);
  Put(o, "framework_version", s.framework_version);
  Put(o, "format", s.format);
  Put(o, "driver", s.driver);
  Put(o, "tp", s.tp);
  Put(o, "pp", s.pp);
  Put(o, "vpp", s.vpp);
  Put(o, "dp", s.dp);
  Put(o, "cp", s.cp);
  Put(o, "ep", s.ep);
  Put(o, "zero_stage", s.zero_stage);
  Put(o, "world", s.world);
  Put(o, "first_stage_layers", s.first_stage_layers);
  Put(o, "last_stage_layers", s.last_stage_layers);
  Put(o, "distributed_optimizer", s.distributed_optimizer);
  Put(o, "padded_vocab_size", s.padded_vocab_size);
  Put(o, "dtype", s.dtype);
  PutStrings(o, "dtypes", s.dtypes);
  Put(o, "layout", s.layout);
  Put(o, "names", s.names);
  PutOpaque(o, s.other);
  return o;
}

ModelInfo ReadModel(const std::string& text,
                    const std::filesystem::path& file) {
  ModelInfo m;
  ReadAttr(text, "model", file, [&](const Value& object, RecordReader&) {
    std::vector<std::pair<std::string, Value>> other;
    for (const auto& [k, v] : object.members()) {
      if (v.is_int()) {
        m.variables.push_back({k, v.AsInt(), false});
      } else if (v.is_bool()) {
        m.variables.push_back({k, v.AsBool() ? 1 : 0, true});
      } else {
        other.emplace_back(k, v);
      }
    }
    m.other = Value::FromMembers(std::move(other));
  });
  return m;
}

Value WriteModel(const ModelInfo& m) {
  Value o = Value::Object();
  for (const ModelVariable& v : m.variables)
    o[v.name] = v.is_bool ? Value(v.value != 0) : Value(v.value);
  PutOpaque(o, m.other);
  return o;
}

// A number into `out`; `int_bit` set in `mask` if it is a JSON integer.
void GetNumber(RecordReader& r, const char* key, std::optional<double>& out,
               uint8_t& mask, uint8_t int_bit) {
  r.Member(key, /*required=*/false, [&](const Value& v) {
    out = v.AsDouble();
    if (v.is_int()) mask |= int_bit;
  });
}

ParamGroup ReadGroup(const Value& g) {
  if (!g.is_object()) throw FormatError("a param group is not an object");
  ParamGroup p;
  RecordReader r(g);
  GetNumber(r, "lr", p.lr, p.int_mask, 1);
  GetNumber(r, "eps", p.eps, p.int_mask, 2);
  GetNumber(r, "weight_decay", p.weight_decay, p.int_mask, 4);
  // betas typed only as a pair of numbers; kept opaque otherwise.
  const Value* b = g.Find("betas");
  if (b != nullptr && b->is_array() && b->size() == 2 &&
      b->items()[0].is_number() && b->items()[1].is_number()) {
    r.Member("betas", /*required=*/false,
             [&](const Value& v) { p.Set("betas", v); });
  }
  r.Get("params", p.params);
  p.other = r.Rest();
  return p;
}

Value WriteGroup(const ParamGroup& p) {
  Value o = Value::Object();
  PutStrings(o, "params", p.params);
  if (p.lr) o["lr"] = NumberValue(*p.lr, p.int_mask & 1);
  if (p.betas) {
    Value b = Value::Array();
    b.Append(NumberValue((*p.betas)[0], p.int_mask & 8));
    b.Append(NumberValue((*p.betas)[1], p.int_mask & 16));
    o["betas"] = std::move(b);
  }
  if (p.eps) o["eps"] = NumberValue(*p.eps, p.int_mask & 2);
  if (p.weight_decay)
    o["weight_decay"] = NumberValue(*p.weight_decay, p.int_mask & 4);
  PutOpaque(o, p.other);
  return o;
}

OptimizerInfo ReadOptimizer(const std::string& text,
                            const std::filesystem::path& file) {
  OptimizerInfo opt;
  ReadAttr(text, "optimizer", file, [&](const Value&, RecordReader& r) {
    r.Get("type", opt.type);
    r.Member("groups", /*required=*/false, [&](const Value& g) {
      std::vector<ParamGroup> groups;
      for (const Value& x : g.items()) groups.push_back(ReadGroup(x));
      opt.groups = std::move(groups);
    });
    r.Get("state_kinds", opt.state_kinds);
    r.Get("step", opt.step);
    opt.other = r.Rest();
  });
  return opt;
}

Value WriteOptimizer(const OptimizerInfo& opt) {
  Value o = Value::Object();
  Put(o, "type", opt.type);
  if (opt.groups) {
    Value a = Value::Array();
    for (const ParamGroup& g : *opt.groups) a.Append(WriteGroup(g));
    o["groups"] = std::move(a);
  }
  PutStrings(o, "state_kinds", opt.state_kinds);
  Put(o, "step", opt.step);
  PutOpaque(o, opt.other);
  return o;
}

std::optional<TrainingInfo> ReadTraining(const std::string& text,
                                         const std::filesystem::path& file) {
  if (text.empty()) return std::nullopt;
  TrainingInfo t;
  ReadAttr(text, "training", file, [&](const Value&, RecordReader& r) {
    r.Get("dtype", t.dtype);
    r.Get("step", t.step);
    r.Get("iteration", t.iteration);
    r.Get("global_samples", t.global_samples);
    r.Get("frozen", t.frozen);
    r.Member("shared", /*required=*/false, [&](const Value& s) {
      std::map<std::string, std::string> shared;
      for (const auto& [alias, fqn] : s.members())
        shared[alias] = fqn.AsString();
      t.shared = std::move(shared);
    });
    r.Get("param_order", t.param_order);
    t.other = r.Rest();
  });
  return t;
}

Value WriteTraining(const TrainingInfo& t) {
  Value o = Value::Object();
  Put(o, "dtype", t.dtype);
  Put(o, "step", t.step);
  Put(o, "iteration", t.iteration);
  Put(o, "global_samples", t.global_samples);
  PutStrings(o, "frozen", t.frozen);
  if (t.shared) {
    std::vector<std::pair<std::string, Value>> m;
    for (const auto& [alias, fqn] : *t.shared) m.emplace_back(alias, fqn);
    o["shared"] = Value::FromMembers(std::move(m));
  }
  PutStrings(o, "param_order", t.param_order);
  PutOpaque(o, t.other);
  return o;
}

OpaqueMembers ReadOpaque(const std::string& text, const char* attr,
                         const std::filesystem::path& file) {
  OpaqueMembers m;
  ReadAttr(text, attr, file,
           [&](const Value&, RecordReader& r) { m = r.Rest(); });
  return m;
}

Value WriteOpaque(const OpaqueMembers& m) {
  Value o = Value::Object();
  PutOpaque(o, m);
  return o;
}

}  // namespace

void ParamGroup::Set(std::string_view key, json::Value x) {
  if (x.is_number() && (key == "lr" || key == "eps" || key == "weight_decay")) {
    const uint8_t bit = key == "lr" ? 1 : key == "eps" ? 2 : 4;
    (key == "lr" ? lr : key == "eps" ? eps : weight_decay) = x.AsDouble();
    int_mask =
        static_cast<uint8_t>(x.is_int() ? int_mask | bit : int_mask & ~bit);
  } else if (key == "betas" && x.is_array() && x.size() == 2 &&
             x.items()[0].is_number() && x.items()[1].is_number()) {
    betas = {x.items()[0].AsDouble(), x.items()[1].AsDouble()};
    int_mask = static_cast<uint8_t>(int_mask & ~(8 | 16));
    if (x.items()[0].is_int()) int_mask |= 8;
    if (x.items()[1].is_int()) int_mask |= 16;
  } else {
    other[key] = std::move(x);
  }
}

std::optional<int64_t> ModelInfo::Get(std::string_view name) const noexcept {
  for (const ModelVariable& v : variables)
    if (v.name == name) return v.value;
  return std::nullopt;
}

void ModelInfo::Set(std::string_view name, int64_t value) {
  for (ModelVariable& v : variables) {
    if (v.name == name) {
      v.value = value;
      v.is_bool = false;
      return;
    }
  }
  variables.push_back({std::string(name), value, false});
}

const json::Value* Model::FindExtra(std::string_view name) const noexcept {
  auto it = extras.find(std::string(name));
  return it == extras.end() ? nullptr : &it->second;
}

json::Value SourceJson(const SourceInfo& source) { return WriteSource(source); }

json::Value VariablesJson(const ModelInfo& variables) {
  return WriteModel(variables);
}

Model ModelFromRoot(const atoms::RootInfo& root,
                    const std::filesystem::path& file) {
  Model m;
  m.version = root.version;
  m.iteration = root.iteration;
  m.consumed_samples = root.consumed_samples;
  m.source = ReadSource(root.source, file);
  m.variables = ReadModel(root.model, file);
  m.layout_yaml = root.layout;
  m.optimizer = ReadOptimizer(root.optimizer, file);
  m.scheduler = ReadOpaque(root.scheduler, "scheduler", file);
  m.args = ReadOpaque(root.args, "args", file);
  m.training = ReadTraining(root.training, file);
  for (const auto& [name, text] : root.extra_strings) {
    const char first = text.empty() ? '\0' : text.front();
    if (first != '{' && first != '[') {  // not a JSON document: kept as text
      m.extra_texts[name] = text;
      continue;
    }
    try {
      m.extras[name] = Value::Parse(text);
    } catch (Error& e) {
      e.AddContext("universal file ", file.string(), " > attribute ", name);
      throw;
    }
  }
  m.extra_ints = root.extra_ints;
  return m;
}

atoms::RootInfo RootFromModel(const Model& m) {
  atoms::RootInfo root;
  root.version = m.version;
  root.iteration = m.iteration;
  root.consumed_samples = m.consumed_samples;
  root.source = WriteSource(m.source).Dump();
  root.model = WriteModel(m.variables).Dump();
  root.layout = m.layout_yaml;
  root.optimizer = WriteOptimizer(m.optimizer).Dump();
  root.scheduler = WriteOpaque(m.scheduler).Dump();
  root.args = WriteOpaque(m.args).Dump();
  root.training = m.training ? WriteTraining(*m.training).Dump() : "";
  root.extra_strings = m.extra_texts;
  for (const auto& [name, doc] : m.extras)
    root.extra_strings[name] = doc.Dump();
  root.extra_ints = m.extra_ints;
  return root;
}

TrainingInfo& NewTraining(Model& model, std::string dtype) {
  TrainingInfo& training = model.training.emplace();
  training.dtype = std::move(dtype);
  training.step = model.iteration;
  training.frozen.emplace();
  training.shared.emplace();
  training.param_order.emplace();
  return training;
}

}  // namespace ucp::universal
