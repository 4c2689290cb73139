#include "engine/dist/assign.h"

#include <algorithm>
#include <numeric>
#include <queue>
#include <utility>

#include "engine/core/error.h"

namespace ucp::dist {

std::vector<int> AssignFiles(std::span<const FileLoad> files, int world) {
  if (world < 1) throw UsageError("a job of ", world, " processes");
  std::vector<int> owner(files.size(), 0);
  std::vector<size_t> order;
  for (size_t i = 0; i < files.size(); ++i)
    if (files[i].slots) order.push_back(i);
  std::stable_sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return files[a].bytes > files[b].bytes;
  });
  // (bytes so far, rank): the smallest first.
  using Load = std::pair<uint64_t, int>;
  std::priority_queue<Load, std::vector<Load>, std::greater<Load>> loads;
  for (int r = 0; r < world; ++r) loads.push({0, r});
  for (const size_t i : order) {
    Load least = loads.top();
    loads.pop();
    owner[i] = least.second;
    least.first += files[i].bytes;
    loads.push(least);
  }
  return owner;
}

}  // namespace ucp::dist
