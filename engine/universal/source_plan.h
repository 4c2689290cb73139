#pragma once
// What a format driver hands the universal-file writer: every atom (param x
// state kind) as a list of fragments, each a box of a rank-local tensor in a
// source file mapped to a box of the atom. Fragments may repeat a region
// (replicas: TP-replicated norms, tied embedding copies); the writer copies
// the first and verifies the others bit for bit.

#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "engine/atoms/atom_store.h"
#include "engine/core/box.h"
#include "engine/reshape/executor.h"
#include "engine/reshape/plan.h"
#include "engine/universal/model.h"

namespace ucp::universal {

struct Fragment {
  reshape::SourceTensor src;  // the rank-local tensor (contiguous)
  Box src_box;                // region of the local tensor
  Box atom_box;               // region of the atom (or of its pad atom)
  bool pad = false;   // atom_box lies in the pad atom (vocab padding rows)
  std::string where;  // "rank file <path> > <key path>" for messages
};

struct AtomPlan {
  std::string param;              // canonical name
  std::string state_kind;         // fp32, exp_avg, exp_avg_sq, param, step, ...
  DType dtype = DType::kFloat32;  // stored dtype
  Shape shape;                    // full logical shape (true vocab size)
  Shape pad_shape;                // padding rows kept verbatim; empty if none
  std::vector<Fragment> fragments;
};

struct OpaqueBlob {
  std::string key;  // e.g. "args", "rng_state/tp00_pp000"
  std::string
      bytes;  // torch.save bytes (torch.load(io.BytesIO(...)) reads them)
};

struct SourcePlan {
  Model model;  // what the universal file's root attributes hold
  std::vector<atoms::ParamInfo> params;
  std::vector<AtomPlan> atoms;
  std::vector<OpaqueBlob> opaque;
  /// Byte sources indexed by SourceTensor::source.
  std::vector<std::unique_ptr<reshape::ByteSource>> sources;
};

}  // namespace ucp::universal
