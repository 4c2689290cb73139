#include "layouts/glob.h"

#include <algorithm>
#include <numeric>
#include <vector>

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

// Matcher for patterns with '#' (one or more decimal digits) as well as
// '*': dynamic programming over (pattern position, name position), from the
// ends, one row of the name at a time. O(|pattern| |name|) time (a run of
// '*' counts once), O(|name|) memory: no backtracking (found by fuzzing:
// "*#*...*" patterns took exponential time).
bool WildMatch(std::string_view pattern, std::string_view name) {
  const size_t n = name.size();
  // next[j]: pattern[i + 1 ..] matches name[j ..]; cur[j]: pattern[i ..].
  std::vector<char> next(n + 1, 0), cur(n + 1, 0);
  next[n] = 1;
  for (size_t i = pattern.size(); i-- > 0;) {
    const char c = pattern[i];
    if (c == '*') {
      if (i + 1 < pattern.size() && pattern[i + 1] == '*') continue;
      cur[n] = next[n];
      for (size_t j = n; j-- > 0;) cur[j] = next[j] || cur[j + 1];
    } else if (c == '#') {  // one digit, then the end or more digits
      cur[n] = 0;
      for (size_t j = n; j-- > 0;)
        cur[j] = IsDigit(name[j]) && (next[j + 1] || cur[j + 1]);
    } else {
      cur[n] = 0;
      for (size_t j = n; j-- > 0;) cur[j] = name[j] == c && next[j + 1];
    }
    std::swap(cur, next);
  }
  return next[0] != 0;
}

}  // namespace

bool StarMatch(std::string_view pattern, std::string_view name) {
  // Every character but '*' takes at least one of the name's.
  const size_t stars =
      static_cast<size_t>(std::count(pattern.begin(), pattern.end(), '*'));
  const size_t needed = pattern.size() - stars;
  if (needed > name.size()) return false;
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
