#pragma once
// Emit (formats/emit.h) over the processes of a job: files assigned by
// AssignFiles (assign.h), reports gathered to rank 0 through the
// Coordinator.

#include <optional>
#include <vector>

#include "engine/dist/coordinator.h"
#include "engine/formats/emit.h"
#include "engine/json/json.h"

namespace ucp::dist {

class JobSplit : public formats::EmitSplit {
 public:
  explicit JobSplit(Coordinator& coordinator) : coordinator_(coordinator) {}

  int rank() const override { return coordinator_.rank(); }
  std::vector<int> Assign(const std::vector<File>& files) override;
  /// Adds "rank", "host" and the store's counts to `report`, gathers.
  std::optional<std::vector<json::Value>> Finished(json::Value report) override;

  /// On rank 0 after Finished: per process {"rank", "host", "files",
  /// "bytes_written", "bytes_read", "seconds", "store_messages",
  /// "store_bytes"}, in rank order; else an empty array.
  json::Value Processes() const;

 private:
  Coordinator& coordinator_;
  std::vector<json::Value> reports_;
};

}  // namespace ucp::dist
