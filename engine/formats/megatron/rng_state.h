#pragma once
// numpy's module path in Megatron's RNG states (`rng_state` of
// model_optim_rng.pt), and the legacy target option `--rng-state` that
// chooses how a target writes them. (torch_dist's `rng_state` ShardedObjects
// are read by DCP with weights_only=False, where numpy 2 still resolves numpy
// 1's path: that writer keeps them as they are.)
//
// Megatron saves `np.random.get_state()` in each rank's RNG state: a tuple
// ('MT19937', uint32 ndarray of 624 keys, pos, has_gauss, cached_gaussian).
// Pickled, the ndarray names numpy's array-rebuilding function by the module
// of the numpy that saved it:
//   numpy 1:  GLOBAL numpy.core.multiarray _reconstruct
//   numpy 2:  GLOBAL numpy._core.multiarray _reconstruct
// (beside `numpy ndarray` and `numpy dtype`, the same in both). torch >= 2.6
// loads a legacy rank file with weights_only=True, which accepts a global
// only by that name; Megatron-core registers its allow-list from the running
// numpy (megatron/core/safe_globals.py: `_reconstruct`, `ndarray`, `dtype`,
// `UInt32DType`), so under numpy 2 it names numpy._core.multiarray and a
// state saved under numpy 1 is refused (megatron/training/checkpointing.py:
// "could not load the checkpoint", then sys.exit() with status 0), and the
// other way round under numpy 1.
//
// --rng-state keep | numpy2 | numpy1 | drop:
//   keep    the states as the source holds them (a note when they name one
//           numpy's module path, which the other numpy's Megatron refuses);
//   numpy2  every global under numpy.core respelled numpy._core (numpy >= 2);
//   numpy1  every global under numpy._core respelled numpy.core (numpy 1);
//   drop    no RNG state: the target loads with --no-load-rng (or
//           --finetune) and keeps the state Megatron's --seed gives.
// Nothing else of a state changes: the same keys, counters and tensors.

#include <cstdint>
#include <string>
#include <string_view>

#include "engine/formats/options.h"
#include "engine/pickle/value.h"

namespace ucp::megatron {

inline constexpr const char* kRngStateOption = "rng-state";

enum class RngStateMode : uint8_t { kKeep, kNumpy2, kNumpy1, kDrop };

/// The declaration of --rng-state for a Megatron target (`what` opens its
/// help line: "Megatron", "torch_dist").
formats::OptionSpec RngStateOptionSpec(std::string_view what);

/// --rng-state's value (kKeep when absent). Throws UsageError naming the
/// option, the value and the values it takes.
RngStateMode ParseRngStateMode(const formats::OptionValues& values);

/// The numpy module paths the globals of a graph use.
struct NumpyPaths {
  bool numpy1 = false;  // numpy.core, numpy.core.*
  bool numpy2 = false;  // numpy._core, numpy._core.*
};

/// Respells, in the graph at `root` (cycles and sharing allowed), every
/// global under numpy.core as numpy._core (kNumpy2) or the other way round
/// (kNumpy1); kKeep and kDrop change nothing. Returns the paths the graph
/// named before. Never throws.
NumpyPaths ApplyRngStateMode(pickle::Value* root, RngStateMode mode);

/// The note a target's summary gives for its RNG states: `found` is what
/// the states written (or, for kDrop, left out) named; "" when there is
/// nothing to say.
std::string RngStateNote(RngStateMode mode, NumpyPaths found, bool any_state);

}  // namespace ucp::megatron
