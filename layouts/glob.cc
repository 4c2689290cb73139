#include "layouts/glob.h"

#include <algorithm>
#include <numeric>

#include "engine/core/error.h"

namespace ucp::layouts {
namespace {

constexpr size_t kMaxAlternatives = 1024;

}  // namespace

Glob Glob::Compile(std::string_view pattern) {
  Glob glob;
  glob.pattern_ = std::string(pattern);
  std::vector<std::string> out = {""};
  size_t i = 0;
  while (i < pattern.size()) {
    const char c = pattern[i];
    if (c == '}') {
      throw LayoutError("pattern '", pattern, "': column ", i + 1,
                        ": '}' without '{'");
    }
    if (c != '{') {
      for (std::string& s : out) s += c;
      ++i;
      continue;
    }
    const size_t close = pattern.find('}', i + 1);
    if (close == std::string_view::npos) {
      throw LayoutError("pattern '", pattern, "': column ", i + 1,
                        ": '{' without '}'");
    }
    const std::string_view body = pattern.substr(i + 1, close - i - 1);
    if (const size_t nested = body.find('{');
        nested != std::string_view::npos) {
      throw LayoutError("pattern '", pattern, "': column ", i + 2 + nested,
                        ": nested '{' is not supported");
    }
    std::vector<std::string_view> choices;
    size_t start = 0;
    while (true) {
      const size_t comma = body.find(',', start);
      choices.push_back(body.substr(start, comma - start));
      if (comma == std::string_view::npos) break;
      start = comma + 1;
    }
    if (out.size() * choices.size() > kMaxAlternatives) {
      throw LayoutError("pattern '", pattern, "' expands to more than ",
                        kMaxAlternatives, " alternatives");
    }
    std::vector<std::string> next;
    next.reserve(out.size() * choices.size());
    for (const std::string& s : out) {
      for (std::string_view choice : choices)
        next.push_back(s + std::string(choice));
    }
    out = std::move(next);
    i = close + 1;
  }
  glob.expanded_ = std::move(out);
  return glob;
}

bool Glob::Matches(std::string_view name) const {
  return std::any_of(expanded_.begin(), expanded_.end(),
                     [&](const std::string& p) { return StarMatch(p, name); });
}

namespace {

bool IsDigit(char c) { return c >= '0' && c <= '9'; }

// Backtracking matcher for patterns with '#' (one or more decimal digits)
// as well as '*'. Patterns hold a handful of wildcards, names are short.
bool WildMatch(std::string_view pattern, std::string_view name) {
  if (pattern.empty()) return name.empty();
  const char c = pattern[0];
  if (c == '*') {
    for (size_t k = 0; k <= name.size(); ++k)
      if (WildMatch(pattern.substr(1), name.substr(k))) return true;
    return false;
  }
  if (c == '#') {
    for (size_t k = 0; k < name.size() && IsDigit(name[k]); ++k)
      if (WildMatch(pattern.substr(1), name.substr(k + 1))) return true;
    return false;
  }
  return !name.empty() && name[0] == c &&
         WildMatch(pattern.substr(1), name.substr(1));
}

}  // namespace

bool StarMatch(std::string_view pattern, std::string_view name) {
  if (pattern.find('#') != std::string_view::npos)
    return WildMatch(pattern, name);
  // Greedy matching with one backtrack point (the last '*'): linear-ish and
  // exact for patterns whose only metacharacter is '*'.
  size_t p = 0, n = 0;
  size_t star = std::string_view::npos, star_n = 0;
  while (n < name.size()) {
    if (p < pattern.size() && pattern[p] == '*') {
      star = p++;
      star_n = n;
    } else if (p < pattern.size() && pattern[p] == name[n]) {
      ++p;
      ++n;
    } else if (star != std::string_view::npos) {
      p = star + 1;
      n = ++star_n;
    } else {
      return false;
    }
  }
  while (p < pattern.size() && pattern[p] == '*') ++p;
  return p == pattern.size();
}

size_t EditDistance(std::string_view a, std::string_view b, size_t limit) {
  // The distance is at least the difference of the lengths, and never less
  // than the smallest entry of a row.
  const size_t gap =
      a.size() > b.size() ? a.size() - b.size() : b.size() - a.size();
  if (gap >= limit) return limit;
  std::vector<size_t> row(b.size() + 1);
  std::iota(row.begin(), row.end(), size_t{0});
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    size_t least = row[0];
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min(
          {row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      least = std::min(least, row[j]);
      diag = up;
    }
    if (least >= limit) return limit;
  }
  return std::min(row[b.size()], limit);
}

}  // namespace ucp::layouts
