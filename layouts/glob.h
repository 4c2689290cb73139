#pragma once
// Name patterns of layout descriptors.
//
//   *        any run of characters, dots included ("decoder.layers.*.weight")
//   #        a decimal number: one or more digits ("#.weight" matches
//            "9.weight" but not "9.input_layernorm.weight"; PipelineModule
//            names)
//   {a,b,c}  one of the comma-separated alternatives (no nesting; an
//            alternative may be empty: "norm{,_1}")
//   anything else matches itself.

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace ucp::layouts {

class Glob {
 public:
  /// Throws LayoutError on an unbalanced or nested brace, or when the
  /// alternatives expand to more than 1024 patterns.
  static Glob Compile(std::string_view pattern);

  bool Matches(std::string_view name) const;
  /// The pattern as written.
  const std::string& pattern() const { return pattern_; }
  /// The brace-free patterns it stands for, in order.
  const std::vector<std::string>& alternatives() const { return expanded_; }

 private:
  std::string pattern_;
  std::vector<std::string> expanded_;
};

/// Matches a brace-free pattern ('*' and '#') against a name.
bool StarMatch(std::string_view pattern, std::string_view name);

/// Levenshtein distance (for "closest pattern" hints), or `limit` if it is
/// at least `limit`: then the work stops early (O(|a| |b|) at most, O(1)
/// when the lengths differ by `limit` or more).
size_t EditDistance(std::string_view a, std::string_view b,
                    size_t limit = SIZE_MAX);

}  // namespace ucp::layouts
