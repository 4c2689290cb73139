#pragma once
// Which process writes which file of a target checkpoint: a pure function of
// the files' sizes and the number of processes, so that every process of a
// job computes the same assignment without exchanging it.

#include <cstdint>
#include <span>
#include <vector>

namespace ucp::dist {

struct FileLoad {
  uint64_t bytes = 0;  // tensor bytes the file's slots hold
  bool slots = false;  // false: a tracker, metadata, index (written last)
};

/// The process (0 .. world - 1) that writes each file. Files with slots go,
/// largest first (ties: the earlier file), to the process with the fewest
/// bytes so far (ties: the lower rank): every process's total then differs
/// from the mean by at most the largest file. Files without slots go to
/// rank 0. Throws UsageError if world < 1.
std::vector<int> AssignFiles(std::span<const FileLoad> files, int world);

}  // namespace ucp::dist
