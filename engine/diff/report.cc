// The report of diff.h as JSON and as text lines.

#include <cmath>
#include <string>
#include <vector>

#include "engine/core/error.h"
#include "engine/diff/diff.h"
#include "engine/json/json.h"

namespace ucp::diff {

namespace {

json::Value ShapeJson(const Shape& shape) {
  json::Value v = json::Value::Array();
  for (int64_t d : shape) v.Append(d);
  return v;
}

std::string ShapeText(const Shape& shape) {
  std::string s = "[";
  for (size_t i = 0; i < shape.size(); ++i)
    s += StrCat(i ? ", " : "", shape[i]);
  return s + "]";
}

const char* StateStatus(const StateDiff& s) {
  if (s.derived) return "derived";
  if (!s.in_b) return "only_in_a";
  if (!s.in_a) return "only_in_b";
  if (s.shape_differs()) return "shape_differs";
  if (s.values_compared && s.values.differing > 0) return "values_differ";
  if (s.dtype_differs()) return "dtype_differs";
  return "equal";
}

const char* ParamStatus(const ParamDiff& p) {
  if (!p.in_b) return "only_in_a";
  if (!p.in_a) return "only_in_b";
  return p.equal() ? "equal" : "differs";
}

std::string Number(double v) {
  if (std::isinf(v)) return "inf";
  return StrCat(json::Value(v).Dump());
}

}  // namespace

json::Value ToJson(const Report& r) {
  json::Value j;
  j["equal"] = r.equal();
  json::Value side;
  side["path"] = r.a;
  side["format"] = r.a_format;
  j["a"] = side;
  side["path"] = r.b;
  side["format"] = r.b_format;
  j["b"] = std::move(side);
  json::Value tol;
  tol["atol"] = r.tolerance.atol;
  tol["rtol"] = r.tolerance.rtol;
  tol["exact"] = r.tolerance.exact();
  j["tolerance"] = std::move(tol);
  json::Value sum;
  int64_t only_a = 0, only_b = 0, differ = 0;
  for (const ParamDiff& p : r.params) {
    only_a += p.in_a && !p.in_b;
    only_b += p.in_b && !p.in_a;
    differ += p.in_a && p.in_b && !p.equal();
  }
  sum["params_in_a_only"] = only_a;
  sum["params_in_b_only"] = only_b;
  sum["params_compared"] = r.params_compared;
  sum["params_differing"] = differ;
  sum["states_compared"] = r.states_compared;
  sum["elements_compared"] = r.elements_compared;
  sum["differing_elements"] = r.differing_elements;
  sum["derived_states"] = r.derived_states;
  sum["bytes_read"] = r.bytes_read;
  j["summary"] = std::move(sum);
  json::Value params = json::Value::Array();
  for (const ParamDiff& p : r.params) {
    json::Value e;
    e["name"] = p.name;
    e["status"] = ParamStatus(p);
    json::Value states = json::Value::Array();
    for (const StateDiff& s : p.states) {
      json::Value x;
      x["state"] = s.state;
      x["status"] = StateStatus(s);
      if (s.in_a) {
        x["a"]["dtype"] = std::string(DTypeName(s.a_dtype));
        x["a"]["shape"] = ShapeJson(s.a_shape);
      }
      if (s.in_b) {
        x["b"]["dtype"] = std::string(DTypeName(s.b_dtype));
        x["b"]["shape"] = ShapeJson(s.b_shape);
      }
      if (!s.note.empty()) x["note"] = s.note;
      if (s.in_a && s.in_b) {
        x["shape_differs"] = s.shape_differs();
        x["dtype_differs"] = s.dtype_differs();
      }
      x["values_compared"] = s.values_compared;
      if (s.values_compared) {
        x["elements"] = s.values.compared;
        x["differing"] = s.values.differing;
        if (s.values.differing > 0) {
          x["first_index"] = ShapeJson(s.first_index);
          x["first_flat_index"] = s.values.first;
          x["max_abs"] = s.values.max_abs;  // null when infinite
          x["max_rel"] = s.values.max_rel;
        }
      }
      states.Append(std::move(x));
    }
    e["states"] = std::move(states);
    params.Append(std::move(e));
  }
  j["params"] = std::move(params);
  return j;
}

std::vector<std::string> DifferenceLines(const Report& r) {
  std::vector<std::string> lines;
  for (const ParamDiff& p : r.params) {
    if (!p.in_b) {
      lines.push_back(StrCat("param ", p.name, ": only in A"));
      continue;
    }
    if (!p.in_a) {
      lines.push_back(StrCat("param ", p.name, ": only in B"));
      continue;
    }
    for (const StateDiff& s : p.states) {
      if (s.equal()) continue;
      const std::string what = StrCat("param ", p.name, " > ", s.state, ": ");
      const std::string note = s.note.empty() ? "" : StrCat(" (", s.note, ")");
      if (!s.in_b) {
        lines.push_back(what + "only in A" + note);
      } else if (!s.in_a) {
        lines.push_back(what + "only in B" + note);
      } else if (s.shape_differs()) {
        lines.push_back(StrCat(what, "shape ", ShapeText(s.a_shape), " vs ",
                               ShapeText(s.b_shape)));
      } else {
        std::string line = what;
        if (s.dtype_differs()) {
          line += StrCat("dtype ", DTypeName(s.a_dtype), " vs ",
                         DTypeName(s.b_dtype),
                         s.values_compared ? " (compared as values)"
                                           : " (values not comparable)");
          if (s.values_compared && s.values.differing == 0)
            line += ", values equal";
          if (s.values.differing > 0) line += ", ";
        }
        if (s.values.differing > 0) {
          line +=
              StrCat(s.values.differing, " of ", s.values.compared,
                     " elements differ, first at ", ShapeText(s.first_index),
                     ", max abs ", Number(s.values.max_abs), ", max rel ",
                     Number(s.values.max_rel));
        }
        lines.push_back(std::move(line));
      }
    }
  }
  return lines;
}

}  // namespace ucp::diff
