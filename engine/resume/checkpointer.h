#pragma once
// A checkpointer for LibTorch trainers (the one engine part that exposes
// at::Tensor): atomic, rotated, per-rank sharded torch.save files that
// Python's torch.load opens, and a collective Resume that falls back past
// broken checkpoints and reshards when the number of processes changed.
//
// On disk (DIR = CheckpointerOptions::dir):
//
//   DIR/step_000000100/                 a checkpoint: visible only when whole
//     shard_00003-of-00004.pt           rank 3 of 4, torch.save of
//       {"model":     {name: piece, ...},            (+ buffers on rank 0)
//        "optimizer": {"state": {i: {"step": tensor(float), "exp_avg": piece,
//                                    "exp_avg_sq": piece}},
//                      "param_groups": [Python Adam param_groups]},
//        "step": 100, "scaler": {...} or None, "extra": {...},
//        "shard": {"rank": 3, "world_size": 4, "numel": N,
//                  "begin": b, "end": e}}
//     meta.pt                           rank 0, written last: torch.save of
//       {"format": "ucp.checkpointer", "version": 1, "step": 100,
//        "world_size": 4, "numel": N,
//        "params": [(name, [shape...], flat offset), ...]   (model order),
//        "steps": [Adam step of each param], "scaler": ..., "extra": ...}
//   DIR/.step_000000100.partial/        being written (a crash leaves it; the
//                                       next Save or Resume removes it)
//
// The model's parameters (all float32) are laid end to end in
// named_parameters() order into one flat vector of N elements; rank r of W
// owns [r*ceil(N/W), min(N, (r+1)*ceil(N/W))). A piece is the part of a
// parameter inside the slice: shaped like the parameter when it lies there
// whole, else 1-D. Each piece owns its storage (one zip record), so a rank of
// a new world size reads only the byte ranges of its new slice (earlier
// files, whose pieces of one kind view one storage, are read too). Every
// file holds plain dicts, lists, tuples, numbers, strings and tensors, as
// Python's torch.save writes them: torch.load's weights-only unpickler (its
// default since torch 2.6) opens them, as does torch 1.13. (LibTorch 1.13's
// torch::pickle_load does not: it lacks Python's APPEND opcode.)
// With one process the shard is exactly the dict a Python trainer saves:
//   torch.save({"model": model.state_dict(),
//               "optimizer": optimizer.state_dict(), "step": step,
//               "scaler": scaler.state_dict(), "extra": extra}, f)
// (plus the "shard" entry).
//
// Atomicity: each shard is written under a temporary name, fsynced and
// renamed into the partial folder; after a barrier rank 0 writes meta.pt the
// same way, fsyncs the folder, renames it to step_<N> and fsyncs DIR. A
// checkpoint is therefore either whole or invisible. Rank 0 then removes the
// oldest complete checkpoints beyond keep_last.

#include <chrono>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

// LibTorch types by forward declaration only: their definitions are
// included by checkpointer.cc and by the trainer that calls this.
namespace at {
class Tensor;
}
namespace c10 {
struct IValue;
template <class Key, class Value>
class Dict;
}  // namespace c10
namespace torch::nn {
class Module;
}
namespace torch::optim {
class Optimizer;
}

namespace ucp::resume {

/// The processes of one training job (LibTorch c10d: a TCPStore rendezvous
/// and a Gloo process group), or a single process.
class ProcessGroup {
 public:
  /// One process: rank 0 of 1, no communication.
  static ProcessGroup Single();
  /// RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from the environment (as
  /// torchrun sets them); Single() when WORLD_SIZE is unset or 1. Every
  /// collective fails after `timeout` when a rank never arrives or dies.
  /// Throws IoError if the rendezvous fails or times out, UsageError on a
  /// malformed variable.
  static ProcessGroup FromEnv(std::chrono::milliseconds timeout);
  static ProcessGroup Connect(int rank, int world_size,
                              const std::string& master_addr, int master_port,
                              std::chrono::milliseconds timeout);

  int rank() const noexcept;
  int size() const noexcept;
  /// Averages `t` (float32, contiguous) over the ranks in place.
  /// Throws IoError naming `what` on a failure or timeout.
  void AllReduceMean(at::Tensor& t, std::string_view what) const;
  void Barrier(std::string_view what) const;

  struct Impl;
  const std::shared_ptr<Impl>& impl() const noexcept { return impl_; }

 private:
  explicit ProcessGroup(std::shared_ptr<Impl> impl);
  std::shared_ptr<Impl> impl_;
};

/// torch.cuda.amp.GradScaler's state (state_dict keys).
struct ScalerState {
  double scale = 65536.0;
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  int64_t growth_interval = 2000;
  int64_t growth_tracker = 0;
};

/// What a checkpoint holds. `model` and `optimizer` (torch::optim::Adam or
/// AdamW over exactly the model's parameters) are required; the others are
/// optional.
struct TrainingState {
  torch::nn::Module* model = nullptr;
  torch::optim::Optimizer* optimizer = nullptr;
  ScalerState* scaler = nullptr;
  /// str -> anything torch.save can hold (Python sees a dict).
  c10::Dict<c10::IValue, c10::IValue>* extra = nullptr;  // GenericDict
};

struct CheckpointerOptions {
  std::filesystem::path dir;
  int64_t save_every = 0;  // Due(step): step % save_every == 0 (0: never)
  int keep_last = 2;       // complete checkpoints kept (>= 1)
  ProcessGroup group = ProcessGroup::Single();
  /// Called at named points of Save ("shard-written", "before-commit"); for
  /// tests that kill the process in the middle of a save.
  std::function<void(std::string_view phase, int64_t step)> on_phase;
};

struct ResumeReport {
  int64_t step = 0;
  std::filesystem::path checkpoint;
  int saved_world_size = 0;
  bool resharded = false;
  /// One line per newer checkpoint skipped: "step_000000120: rank 1: ...".
  std::vector<std::string> skipped;
  uint64_t bytes_read = 0;  // by this rank, tensor data only
};

class Checkpointer {
 public:
  /// Throws UsageError on bad options, IoError if `dir` cannot be created.
  explicit Checkpointer(CheckpointerOptions options);
  ~Checkpointer();
  Checkpointer(Checkpointer&&) noexcept;
  Checkpointer& operator=(Checkpointer&&) noexcept;

  bool Due(int64_t step) const noexcept;

  /// Collective: every rank calls it with the same step. Throws UsageError
  /// if the state is not supported (non-float32 parameters, an optimizer
  /// other than Adam/AdamW, parameters missing from it), IoError on write
  /// or communication failures (the previous checkpoints stay intact).
  void Save(int64_t step, const TrainingState& state);

  /// Collective: all ranks agree on the newest checkpoint that is complete
  /// and intact for every rank (meta.pt and every shard present, parsing,
  /// the CRC-32 of every record; the shards are checked by the ranks in
  /// turn), falling back past broken ones; each rank then reads only the
  /// byte ranges of its slice and the ranks exchange slices. Restores the
  /// parameters, buffers, Adam moments and steps, scaler and extra.
  /// Returns nullopt when DIR holds no checkpoint at all. Throws FormatError
  /// when checkpoints exist but none is intact, or the model does not match
  /// (names, shapes); IoError on communication failures or timeouts.
  std::optional<ResumeReport> Resume(const TrainingState& state);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace ucp::resume
