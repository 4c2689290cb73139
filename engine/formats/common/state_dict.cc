#include "engine/formats/common/state_dict.h"

#include <map>
#include <variant>

#include "engine/core/error.h"

namespace ucp::formats {

using pickle::Kind;
using pickle::Value;

std::vector<ChunkLeaf> FlattenChunk(const torchfile::TorchFile& file,
                                    const Value* chunk) {
  if (chunk == nullptr || !chunk->IsDictLike()) {
    throw FormatError("model state dict is not a dict (",
                      pickle::Repr(chunk, 60), ")");
  }
  std::vector<ChunkLeaf> out;
  struct Frame {
    const Value* dict;
    size_t next;
  };
  std::vector<Frame> stack{{chunk, 0}};
  std::vector<std::string> path;
  while (!stack.empty()) {
    Frame& f = stack.back();
    if (f.next == f.dict->entries.size()) {
      stack.pop_back();
      if (!path.empty()) path.pop_back();
      continue;
    }
    const auto& [key, value] = f.dict->entries[f.next++];
    if (key == nullptr || key->kind != Kind::kStr) {
      throw FormatError("model state dict key ", pickle::Repr(key, 40),
                        " is not a str");
    }
    if (value != nullptr && value->IsDictLike()) {
      if (stack.size() > 16) {
        throw FormatError("model state dict nested deeper than 16 levels");
      }
      path.push_back(key->s);
      stack.push_back({value, 0});
      continue;
    }
    ChunkLeaf leaf;
    leaf.key_path = path;
    leaf.key_path.push_back(key->s);
    for (size_t i = 0; i < leaf.key_path.size(); ++i) {
      if (i) leaf.name += '.';
      leaf.name += leaf.key_path[i];
    }
    leaf.value = value;
    leaf.tensor = file.FindTensor(value);
    out.push_back(std::move(leaf));
  }
  return out;
}

Value* NewOrderedDict(pickle::Arena& arena) {
  return arena.Object(pickle::ObjectOp::kReduce,
                      arena.Global("collections", "OrderedDict"),
                      arena.Tuple({}));
}

void AppendEntry(pickle::Arena& arena, Value* dict, std::string_view key,
                 Value* value) {
  dict->entries.emplace_back(arena.Str(std::string(key)), value);
}

Value* BuildChunk(
    pickle::Arena& arena,
    const std::vector<std::pair<std::vector<std::string>, Value*>>& leaves) {
  // A tree of levels in first-appearance order; each level knows whether
  // it holds leaves (then it becomes an OrderedDict).
  struct Level {
    std::map<std::string, size_t, std::less<>> child_index;
    bool has_leaf = false;
    std::vector<std::pair<std::string, std::variant<Value*, size_t>>> order;
  };
  std::vector<Level> levels(1);
  for (const auto& [path, value] : leaves) {
    UCP_CHECK(!path.empty(), "empty key path");
    size_t cur = 0;
    for (size_t i = 0; i + 1 < path.size(); ++i) {
      auto it = levels[cur].child_index.find(path[i]);
      size_t next;
      if (it == levels[cur].child_index.end()) {
        next = levels.size();
        levels[cur].child_index.emplace(path[i], next);
        levels[cur].order.emplace_back(path[i], next);
        levels.emplace_back();
      } else {
        next = it->second;
      }
      cur = next;
    }
    UCP_CHECK(levels[cur].child_index.count(path.back()) == 0, "key ",
              path.back(), " is both a leaf and a nested level");
    levels[cur].has_leaf = true;
    levels[cur].order.emplace_back(path.back(), value);
  }
  // Build bottom-up: children always have larger indices than parents.
  std::vector<Value*> nodes(levels.size(), nullptr);
  for (size_t i = levels.size(); i-- > 0;) {
    Value* node = levels[i].has_leaf ? NewOrderedDict(arena) : arena.Dict();
    for (const auto& [key, item] : levels[i].order) {
      Value* v = std::holds_alternative<Value*>(item)
                     ? std::get<Value*>(item)
                     : nodes[std::get<size_t>(item)];
      AppendEntry(arena, node, key, v);
    }
    nodes[i] = node;
  }
  return nodes[0];
}

}  // namespace ucp::formats
