#include "engine/formats/mindspore/strategy.h"

#include <algorithm>
#include <charconv>
#include <set>
#include <string_view>

#include "engine/core/error.h"
#include "engine/core/file.h"
#include "engine/core/strided.h"
#include "engine/json/json.h"
#include "layouts/placement.h"

namespace ucp::mindspore {
namespace {

namespace fs = std::filesystem;

constexpr uint64_t kMaxStrategyBytes = 256ull << 20;

// A protobuf message in memory.
class Msg {
 public:
  Msg(std::string_view bytes, const std::string& where)
      : p_(bytes), where_(where) {}
  bool done() const { return at_ >= p_.size(); }
  uint64_t Varint() {
    uint64_t v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (at_ >= p_.size()) Fail("a field ends early");
      const auto b = static_cast<uint8_t>(p_[at_++]);
      v |= static_cast<uint64_t>(b & 0x7f) << shift;
      if ((b & 0x80) == 0) return v;
    }
    Fail("a varint longer than 10 bytes");
  }
  std::string_view Bytes() {
    const uint64_t n = Varint();
    if (n > p_.size() - at_) Fail("a field of ", n, " bytes runs past its end");
    const std::string_view s = p_.substr(at_, n);
    at_ += n;
    return s;
  }
  void Skip(uint32_t wire) {
    switch (wire) {
      case 0:
        Varint();
        return;
      case 1:
      case 5: {
        const size_t n = wire == 1 ? 8 : 4;
        if (n > p_.size() - at_) Fail("a field runs past its end");
        at_ += n;
        return;
      }
      case 2:
        Bytes();
        return;
      default:
        Fail("wire type ", wire, " (not a strategy file)");
    }
  }
  // Repeated integers of field `wire`: one varint, or a packed run.
  template <typename T>
  void Ints(uint32_t wire, std::vector<T>& out) {
    if (wire == 0) {
      out.push_back(static_cast<T>(Varint()));
    } else if (wire == 2) {
      Msg packed(Bytes(), where_);
      while (!packed.done()) out.push_back(static_cast<T>(packed.Varint()));
    } else {
      Fail("a repeated integer of wire type ", wire);
    }
  }
  template <typename... A>
  [[noreturn]] void Fail(const A&... a) const {
    throw FormatError(where_, ": ", a...,
                      " (not a MindSpore strategy file, or damaged)");
  }

 private:
  std::string_view p_;
  size_t at_ = 0;
  const std::string& where_;
};

// The repeated `dim` (field 1) of a DevMatrix / TensorMap / ... message.
template <typename T>
std::vector<T> Dims(std::string_view bytes, const std::string& where) {
  Msg m(bytes, where);
  std::vector<T> out;
  while (!m.done()) {
    const uint64_t key = m.Varint();
    if ((key >> 3) == 1)
      m.Ints(static_cast<uint32_t>(key & 7), out);
    else
      m.Skip(static_cast<uint32_t>(key & 7));
  }
  return out;
}

// tensor_map as stored (one TensorMap per entry) -> per-dim axis lists.
std::vector<std::vector<int64_t>> DimsOfMaps(
    const std::vector<std::vector<int64_t>>& maps) {
  std::vector<std::vector<int64_t>> dims;
  auto axes = [](int64_t a) {
    return a < 0 ? std::vector<int64_t>{} : std::vector<int64_t>{a};
  };
  if (maps.size() == 1) {  // classic: one axis (or -1) per dim
    for (int64_t a : maps[0]) dims.push_back(axes(a));
    return dims;
  }
  for (const std::vector<int64_t>& m : maps) {  // extend: a list per dim
    if (m.empty()) continue;                    // a 1-D tensor's filler
    std::vector<int64_t> d;
    for (int64_t a : m)
      if (a >= 0) d.push_back(a);
    dims.push_back(std::move(d));
  }
  return dims;
}

TensorLayout ParseLayouts(std::string_view bytes, const std::string& where) {
  Msg m(bytes, where);
  TensorLayout l;
  std::vector<std::vector<int64_t>> maps;
  bool dev = false;
  while (!m.done()) {
    const uint64_t key = m.Varint();
    const auto wire = static_cast<uint32_t>(key & 7);
    switch (key >> 3) {
      case 1: {
        if (wire != 2) m.Fail("dev_matrix of wire type ", wire);
        auto d = Dims<int64_t>(m.Bytes(), where);
        if (!dev) l.dev_matrix = std::move(d);  // [0] is the one used
        dev = true;
        break;
      }
      case 2: {
        if (wire != 2) m.Fail("tensor_map of wire type ", wire);
        std::vector<int64_t> t;
        for (uint64_t v : Dims<uint64_t>(m.Bytes(), where))
          t.push_back(static_cast<int32_t>(static_cast<uint32_t>(v)));
        maps.push_back(std::move(t));
        break;
      }
      case 3: {
        if (wire != 2) m.Fail("param_split_shape of wire type ", wire);
        auto s = Dims<int64_t>(m.Bytes(), where);
        if (l.split_shape.empty()) l.split_shape = std::move(s);
        break;
      }
      case 5:
        if (wire != 0) m.Fail("field of wire type ", wire);
        l.field = static_cast<int32_t>(m.Varint());
        break;
      case 6:
        if (wire != 0) m.Fail("opt_weight_shard_step of wire type ", wire);
        l.opt_shard_step = static_cast<int32_t>(m.Varint());
        break;
      case 7:
        if (wire != 0) m.Fail("opt_weight_shard_size of wire type ", wire);
        l.opt_shard_size = static_cast<int32_t>(m.Varint());
        break;
      default:
        m.Skip(wire);
    }
  }
  if (!dev) m.Fail("a layout without dev_matrix");
  if (maps.empty()) m.Fail("a layout without tensor_map");
  l.dims = DimsOfMaps(maps);
  l.extend = maps.size() > 1;
  return l;
}

// "<stage>-<name>" -> (stage, name).
std::pair<int64_t, std::string> StageName(const std::string& name,
                                          int64_t stage) {
  const size_t dash = name.find('-');
  if (dash == std::string::npos || dash == 0) return {stage, name};
  int64_t s = 0;
  const auto r = std::from_chars(name.data(), name.data() + dash, s);
  if (r.ec != std::errc() || r.ptr != name.data() + dash) return {stage, name};
  return {s, name.substr(dash + 1)};
}

void Check(const TensorLayout& l, const std::string& where) {
  if (l.dev_matrix.empty()) throw FormatError(where, ": an empty dev_matrix");
  int64_t devices = 1;
  for (int64_t d : l.dev_matrix) {
    if (d < 1 || d > (1 << 24))
      throw FormatError(where, ": a dev_matrix size of ", d);
    devices *= d;
    if (devices > (int64_t{1} << 31))
      throw FormatError(where, ": a dev_matrix of over 2^31 devices");
  }
  const auto n = static_cast<int64_t>(l.dev_matrix.size());
  std::set<int64_t> seen;
  for (const auto& axes : l.dims) {
    for (int64_t a : axes) {
      if (a >= n)
        throw FormatError(where, ": tensor_map names device axis ", a, " of a ",
                          n, "-axis dev_matrix");
      if (!seen.insert(a).second)
        throw FormatError(where, ": tensor_map uses device axis ", a, " twice");
    }
  }
  if (l.field != 0)
    throw FormatError(where, ": an embedding field split (field ", l.field,
                      "): not supported");
  if (!l.split_shape.empty())
    throw FormatError(where,
                      ": an uneven split (param_split_shape): not supported");
}

void Add(Strategy& s, const std::string& name, int64_t stage, TensorLayout l,
         const std::string& where) {
  const std::string here = StrCat(where, " > ", name);
  Check(l, here);
  auto [it, fresh] = s.layouts[name].emplace(stage, l);
  if (!fresh && !(it->second == l))
    throw FormatError(here, ": two different layouts for stage ", stage);
}

void ReadProto(Strategy& s, const fs::path& file) {
  const std::string where = StrCat("strategy file ", file.string());
  const std::string bytes = ReadSmallFile(file, kMaxStrategyBytes);
  Msg m(bytes, where);
  int64_t current_stage = 0;
  std::vector<std::pair<std::string, TensorLayout>> items;
  while (!m.done()) {
    const uint64_t key = m.Varint();
    const auto wire = static_cast<uint32_t>(key & 7);
    if ((key >> 3) == 1 && wire == 0) {
      current_stage = static_cast<int64_t>(m.Varint());
    } else if ((key >> 3) == 3 && wire == 2) {
      Msg item(m.Bytes(), where);
      std::string name;
      std::string_view layouts;
      bool has = false;
      while (!item.done()) {
        const uint64_t k = item.Varint();
        const auto w = static_cast<uint32_t>(k & 7);
        if ((k >> 3) == 1 && w == 2) {
          name = std::string(item.Bytes());
        } else if ((k >> 3) == 2 && w == 2) {
          layouts = item.Bytes();
          has = true;
        } else {
          item.Skip(w);
        }
      }
      if (name.empty() || !has) m.Fail("a layout item without name or layout");
      items.emplace_back(name,
                         ParseLayouts(layouts, StrCat(where, " > ", name)));
    } else {
      m.Skip(wire);
    }
  }
  for (auto& [name, l] : items) {
    auto [stage, bare] = StageName(name, current_stage);
    Add(s, bare, stage, std::move(l), where);
  }
}

void ReadJson(Strategy& s, const fs::path& file) {
  const std::string where = StrCat("strategy file ", file.string());
  json::Value j;
  try {
    j = json::Value::Parse(ReadSmallFile(file, kMaxStrategyBytes));
  } catch (const FormatError& e) {
    throw FormatError(where, ": ", e.what());
  }
  const json::Value* items = j.Find("parallel_layout_item");
  if (items == nullptr || !items->is_object())
    throw FormatError(where, ": no parallel_layout_item object");
  int64_t current_stage = 0;
  if (const json::Value* cs = j.Find("current_stage"); cs && cs->is_number())
    current_stage = cs->AsInt();
  for (const auto& member : items->members()) {
    // (Not a structured binding: clang 14 cannot capture one in a lambda.)
    const std::string& name = member.first;
    const json::Value& v = member.second;
    const std::string here = StrCat(where, " > ", name);
    TensorLayout l;
    try {
      for (const json::Value& d : v.At("dev_matrix").items())
        l.dev_matrix.push_back(d.AsInt());
      // One entry per tensor dim: a device axis (-1: none), or a list of
      // them (the extend form; the two may mix).
      for (const json::Value& t : v.At("tensor_map").items()) {
        std::vector<int64_t> axes;
        if (t.is_array()) {
          for (const json::Value& a : t.items())
            if (a.AsInt() >= 0) axes.push_back(a.AsInt());
          l.extend = true;
        } else if (t.AsInt() >= 0) {
          axes.push_back(t.AsInt());
        }
        l.dims.push_back(std::move(axes));
      }
      auto num = [&](const char* k) {
        const json::Value* x = v.Find(k);
        return x != nullptr && x->is_number() ? x->AsInt() : int64_t{0};
      };
      l.field = num("field");
      l.opt_shard_step = num("opt_weight_shard_step");
      l.opt_shard_size = num("opt_weight_shard_size");
      if (const json::Value* ps = v.Find("param_split_shape"))
        for (const json::Value& d : ps->items())
          l.split_shape.push_back(d.AsInt());
    } catch (const Error& e) {  // the JSON's own errors name no file
      throw FormatError(here, ": ", e.what());
    }
    auto [stage, bare] = StageName(name, current_stage);
    Add(s, bare, stage, std::move(l), where);
  }
}

void ReadOne(Strategy& s, const fs::path& file) {
  if (file.extension() == ".json")
    ReadJson(s, file);
  else
    ReadProto(s, file);
}

// The layout with the optimizer shard folded in: device sizes (left to
// right) and per tensor dim the device indices (from the left) splitting it,
// major first.
struct Expanded {
  std::vector<int64_t> dev;
  std::vector<std::vector<size_t>> dims;
};

Expanded Expand(const TensorLayout& l, size_t ndim, const std::string& where) {
  Expanded e;
  e.dev = l.dev_matrix;
  const size_t n = e.dev.size();
  if (l.dims.size() != ndim) {
    throw FormatError(where, ": its layout maps ", l.dims.size(),
                      " dims, the tensor has ", ndim);
  }
  for (const auto& axes : l.dims) {
    std::vector<size_t> left;
    for (int64_t a : axes) left.push_back(n - 1 - static_cast<size_t>(a));
    e.dims.push_back(std::move(left));
  }
  if (l.opt_shard_size == 0 || l.opt_shard_step == 0) return e;
  if (ndim == 0) throw FormatError(where, ": an optimizer shard of a scalar");
  std::set<size_t> used;
  for (const auto& axes : e.dims) used.insert(axes.begin(), axes.end());
  std::vector<size_t> repeated;
  for (size_t i = 0; i < n; ++i)
    if (!used.count(i) && e.dev[i] > 1) repeated.push_back(i);
  if (repeated.empty()) {
    throw FormatError(where,
                      ": an optimizer shard, but no device axis is left to "
                      "shard over");
  }
  int64_t total = 1;
  for (int64_t d : e.dev) total *= d;
  if (!l.extend && l.opt_shard_size > 0 &&
      ((repeated.size() == 1 && repeated[0] == 0) || repeated.size() == n)) {
    // transform_checkpoints' layout for this case (strategy.h).
    if (repeated.size() == 1 && total / e.dev[0] != l.opt_shard_step) {
      throw FormatError(where, ": opt_weight_shard_step ", l.opt_shard_step,
                        " is not the model-parallel size ", total / e.dev[0]);
    }
    std::vector<int64_t> counts;
    int64_t split = 1;
    for (const auto& axes : e.dims) {
      int64_t c = 1;
      for (size_t a : axes) c *= e.dev[a];
      counts.push_back(c);
      split *= c;
    }
    const int64_t step_size = l.opt_shard_step * l.opt_shard_size;
    if (step_size > total || total % step_size != 0 ||
        (total / step_size) * l.opt_shard_size * split != total) {
      throw FormatError(where, ": opt_weight_shard_size ", l.opt_shard_size,
                        " and _step ", l.opt_shard_step, " do not fit ", total,
                        " devices");
    }
    const int64_t repeat = total / step_size;
    Expanded x;
    if (repeat > 1) x.dev.push_back(repeat);
    const size_t opt_axis = x.dev.size();
    x.dev.push_back(l.opt_shard_size);
    for (size_t d = 0; d < ndim; ++d) {
      x.dev.push_back(counts[d]);
      x.dims.push_back(counts[d] > 1 ? std::vector<size_t>{opt_axis + 1 + d}
                                     : std::vector<size_t>{});
    }
    x.dims[0].push_back(opt_axis);
    return x;
  }
  int64_t remaining = 1;
  if (l.opt_shard_size > 0) {
    remaining = l.opt_shard_size;
  } else {
    for (size_t i : repeated) remaining *= e.dev[i];
  }
  std::vector<size_t> opt;  // in dev-matrix order
  for (auto it = repeated.rbegin(); it != repeated.rend() && remaining > 1;
       ++it) {
    const size_t i = *it;
    const int64_t size = e.dev[i];
    if (remaining < size) {
      if (size % remaining != 0) {
        throw FormatError(where, ": opt_weight_shard_size ", l.opt_shard_size,
                          " does not divide device axis ", n - 1 - i, " (",
                          size, ")");
      }
      // Axis i becomes (size / remaining, remaining); the minor part shards.
      e.dev[i] = size / remaining;
      e.dev.insert(e.dev.begin() + static_cast<ptrdiff_t>(i) + 1, remaining);
      for (auto& axes : e.dims)
        for (size_t& a : axes)
          if (a > i) ++a;
      for (size_t& a : opt) ++a;
      opt.insert(opt.begin(), i + 1);
      remaining = 1;
    } else {
      if (remaining % size != 0) {
        throw FormatError(where, ": opt_weight_shard_size ", l.opt_shard_size,
                          " is not a product of the free device axes");
      }
      opt.insert(opt.begin(), i);
      remaining /= size;
    }
  }
  if (remaining != 1) {
    throw FormatError(where, ": opt_weight_shard_size ", l.opt_shard_size,
                      " exceeds the devices the layout leaves free");
  }
  e.dims[0].insert(e.dims[0].end(), opt.begin(), opt.end());
  return e;
}

// Protobuf encoding (strategy.h's field numbers).
void PutVarint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}
void PutTag(std::string& out, int field, int wire) {
  PutVarint(out,
            static_cast<uint64_t>(field) << 3 | static_cast<uint64_t>(wire));
}
void PutBytes(std::string& out, int field, std::string_view bytes) {
  PutTag(out, field, 2);
  PutVarint(out, bytes.size());
  out.append(bytes);
}
// A message of one repeated scalar field 1, unpacked (as MindSpore's
// protobuf writes proto2 fields); an int32 < 0 is sign-extended to 64 bits.
std::string Dims(const std::vector<int64_t>& dims) {
  std::string out;
  for (int64_t d : dims) {
    PutTag(out, 1, 0);
    PutVarint(out, static_cast<uint64_t>(d));
  }
  return out;
}

}  // namespace

const TensorLayout* Strategy::Find(const std::string& name,
                                   int64_t rank) const {
  const auto it = layouts.find(name);
  if (it == layouts.end()) return nullptr;
  if (it->second.size() == 1 && stages == 1) return &it->second.begin()->second;
  const int64_t stage = rank / stage_devices;
  const auto s = it->second.find(stage);
  if (s == it->second.end()) {
    throw FormatError("strategy file ", path.string(), " > ", name,
                      ": no layout for stage ", stage, " (rank ", rank, ")");
  }
  return &s->second;
}

bool Strategy::Holds(const std::string& name, int64_t rank) const {
  const auto it = layouts.find(name);
  if (it == layouts.end() || stages == 1) return true;
  return it->second.count(rank / stage_devices) > 0;
}

Strategy ReadStrategy(const fs::path& path) {
  Strategy s;
  s.path = path;
  std::error_code ec;
  if (fs::is_directory(path, ec)) {
    std::vector<fs::path> files;
    for (fs::directory_iterator it(path, ec), end; !ec && it != end;
         it.increment(ec)) {
      if (it->is_regular_file() && (it->path().extension() == ".ckpt" ||
                                    it->path().extension() == ".json"))
        files.push_back(it->path());
    }
    if (files.empty())
      throw FormatError(path.string(), ": no strategy file (.ckpt, .json)");
    std::sort(files.begin(), files.end());
    for (const fs::path& f : files) ReadOne(s, f);
  } else if (fs::is_regular_file(path, ec)) {
    ReadOne(s, path);
  } else {
    throw IoError("strategy file ", path.string(), " does not exist");
  }
  if (s.layouts.empty())
    throw FormatError("strategy file ", path.string(), ": no parameter layout");
  // One device count per stage; stages 0 .. max.
  int64_t max_stage = 0;
  bool first = true;
  for (const auto& [name, by_stage] : s.layouts) {
    for (const auto& [stage, l] : by_stage) {
      int64_t devices = 1;
      for (int64_t d : l.dev_matrix) devices *= d;
      if (first) s.stage_devices = devices;
      first = false;
      if (devices != s.stage_devices) {
        throw FormatError("strategy file ", path.string(), " > ", name,
                          ": a dev_matrix of ", devices, " devices, others ",
                          s.stage_devices);
      }
      if (stage < 0 || stage > 4096)
        throw FormatError("strategy file ", path.string(), " > ", name,
                          ": pipeline stage ", stage);
      max_stage = std::max(max_stage, stage);
    }
  }
  s.stages = max_stage + 1;
  return s;
}

std::vector<int64_t> SplitCounts(const TensorLayout& layout, size_t ndim,
                                 const std::string& where) {
  const Expanded e = Expand(layout, ndim, where);
  std::vector<int64_t> counts;
  for (const auto& axes : e.dims) {
    int64_t c = 1;
    for (size_t a : axes) c *= e.dev[a];
    counts.push_back(c);
  }
  return counts;
}

Box RankBox(const TensorLayout& layout, const Shape& shape, int64_t rank,
            const std::string& where) {
  const Expanded e = Expand(layout, shape.size(), where);
  int64_t devices = 1;
  for (int64_t d : e.dev) devices *= d;
  // The rank's coordinates in its stage's device matrix (row-major).
  std::vector<int64_t> coord(e.dev.size());
  int64_t local = rank % devices;
  for (size_t i = e.dev.size(); i-- > 0;) {
    coord[i] = local % e.dev[i];
    local /= e.dev[i];
  }
  Box box = Box::Whole(shape);
  for (size_t d = 0; d < shape.size(); ++d) {
    int64_t count = 1, index = 0;
    for (size_t a : e.dims[d]) {
      count *= e.dev[a];
      index = index * e.dev[a] + coord[a];
    }
    if (shape[d] % count != 0) {
      throw FormatError(where, ": dim ", d, " of ", ShapeString(shape),
                        " does not split into ", count, " equal parts");
    }
    box.size[d] = shape[d] / count;
    box.offset[d] = index * box.size[d];
  }
  return box;
}

}  // namespace ucp::mindspore

namespace ucp::mindspore {

std::string StrategyFileBytes(const Strategy& s, int64_t stage) {
  std::string out;
  PutTag(out, 1, 0);
  PutVarint(out, static_cast<uint64_t>(stage));
  // One strategy item of the stage: merge_pipeline_strategys reads the
  // stage of a file from its first item.
  std::string strategys;
  PutTag(strategys, 1, 0);
  PutVarint(strategys, static_cast<uint64_t>(stage));
  std::string item;
  PutBytes(item, 1, "ucp");
  PutBytes(item, 2, strategys);
  PutBytes(out, 2, item);
  for (const auto& [name, stages] : s.layouts) {
    const auto it = stages.find(stage);
    if (it == stages.end()) continue;
    const TensorLayout& l = it->second;
    if (l.extend || l.field != 0 || !l.split_shape.empty()) {
      throw FormatError("strategy ", s.path.string(), " > ", name,
                        ": only classic tensor maps are written");
    }
    std::string layouts;
    PutBytes(layouts, 1, Dims(l.dev_matrix));
    std::vector<int64_t> map;
    for (const auto& axes : l.dims) {
      if (axes.size() > 1) {
        throw FormatError("strategy ", s.path.string(), " > ", name,
                          ": a dim split by several axes is not written");
      }
      map.push_back(axes.empty() ? -1 : axes[0]);
    }
    PutBytes(layouts, 2, Dims(map));
    PutBytes(layouts, 3, "");  // param_split_shape, indices_offset: empty,
    PutBytes(layouts, 4, "");  // as MindSpore writes them for even splits
    PutTag(layouts, 5, 0);
    PutVarint(layouts, static_cast<uint64_t>(l.field));
    PutTag(layouts, 6, 0);
    PutVarint(layouts, static_cast<uint64_t>(l.opt_shard_step));
    PutTag(layouts, 7, 0);
    PutVarint(layouts, static_cast<uint64_t>(l.opt_shard_size));
    std::string layout_item;
    PutBytes(layout_item, 1, name);
    PutBytes(layout_item, 2, layouts);
    PutBytes(out, 3, layout_item);
  }
  return out;
}

formats::PlaceRequest DerivedPlaceRequest(const layouts::Topology& t,
                                          bool has_layout,
                                          std::span<const std::string> names) {
  formats::PlaceRequest request;
  request.topology = t;
  request.topology.vpp = 1;
  request.count_layers = true;
  if (!has_layout) {
    const std::vector<std::string> found =
        layouts::Layout::DetectBuiltins(names);
    if (found.empty()) {
      throw UsageError(
          "--tp ", t.tp, " --pp ", t.pp, " --dp ", t.dp,
          ": no layout says how the params are cut (first: ",
          names.empty() ? std::string("none") : names[0],
          "; the built-in one for MindSpore names: mindformers-llama): "
          "give the job's strategy file with --strategy");
    }
    request.layout = layouts::Layout::Builtin(found[0]);
  }
  return request;
}

Strategy DeriveStrategy(std::span<const DerivedTensor> tensors,
                        const layouts::Topology& t,
                        const formats::PlacedTarget* placed) {
  const std::string where =
      StrCat("--tp ", t.tp, " --pp ", t.pp, " --dp ", t.dp);
  UCP_CHECK(placed != nullptr || (t.tp == 1 && t.pp == 1),
            "DeriveStrategy: ", where, " without a placed target");
  Strategy s;
  s.path = t.pp == 1 ? fs::path("strategy.ckpt") : fs::path("strategy");
  s.stage_devices = t.tp * t.dp;
  s.stages = t.pp;
  // Each param's stage and layout; then the tensors taking them.
  std::map<std::string, std::pair<int64_t, TensorLayout>, std::less<>> of;
  for (const DerivedTensor& x : tensors) {
    if (x.name != x.param) continue;
    TensorLayout l;
    l.dev_matrix = {t.dp, t.tp};
    l.dims.assign(x.shape.size(), {});
    int64_t stage = 0;
    if (placed != nullptr) {
      const layouts::Layout& layout = placed->layout;
      const layouts::Rule& rule = layout.Match(x.name, placed->vars);
      if (rule.tp.split && t.tp > 1) {
        if (rule.tp.segments != 1) {
          throw UsageError(where, ": ", x.name, " is cut by ", layout.name(),
                           " ", rule.Describe(), " in ", rule.tp.segments,
                           " segments, which a MindSpore tensor map cannot "
                           "express: give a strategy file with --strategy, or "
                           "write the model under MindFormers' names "
                           "(--names mindformers-llama)");
        }
        const auto d = static_cast<size_t>(rule.tp.dim);
        if (d >= l.dims.size() || x.shape[d] % t.tp != 0) {
          throw LayoutError(where, ": ", x.name, " ", ShapeString(x.shape),
                            ": dim ", d, " does not divide into tp ", t.tp,
                            " parts (", rule.Describe(), " of ", layout.name(),
                            ")");
        }
        l.dims[d] = {0};
      }
      stage = layouts::HomeOf(layout, rule, x.name, placed->placement).pp_rank;
    }
    of[x.name] = {stage, l};
  }
  for (const DerivedTensor& x : tensors) {
    const auto it = of.find(x.param);
    if (it == of.end()) continue;
    TensorLayout l = it->second.second;
    l.dims.resize(x.shape.size());
    s.layouts[x.name][it->second.first] = std::move(l);
  }
  return s;
}

}  // namespace ucp::mindspore
