#pragma once
// What a DCP key holds (dcp.h): a param's weights, its optimizer state, a
// param group's entry, another tensor or another object; from the key's
// planner_data path (torch's own nesting), else from its dotted name.

#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "engine/formats/dcp/metadata.h"

namespace ucp::dcp {

struct KeyClass {
  enum Kind : uint8_t {
    kModel,        // model.<param>
    kState,        // optimizer.state.<param>.<state>
    kParamGroup,   // optimizer.param_groups.<group>.<group_key>
    kParamGroups,  // optimizer.param_groups (the whole list, older torch)
    kTensor,       // any other tensor: a param named by the key
    kBytes,        // any other object
  };
  Kind kind = kBytes;
  std::string param;
  std::string state;
  int64_t group = -1;
  std::string group_key;
};

std::string_view KeyClassName(KeyClass::Kind kind);

class KeyNames {
 public:
  static KeyNames From(const Metadata& m);
  KeyClass Classify(const std::string& fqn, bool tensor) const;

 private:
  std::map<std::string, std::vector<PathComponent>> paths_;
  std::set<std::string> model_params_;
};

/// The planner_data path of a key ucp names itself (a target from another
/// format): model.<p> -> ("model", p); optimizer.state.<p>.<s> ->
/// ("optimizer", "state", p, s); optimizer.param_groups.<g>.<k> ->
/// ("optimizer", "param_groups", g, k).
std::vector<PathComponent> PathOf(const KeyClass& k, const std::string& fqn);

}  // namespace ucp::dcp
