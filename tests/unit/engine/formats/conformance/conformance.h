#pragma once
// The driver conformance suite (conformance_test.cc, in the manner of
// tensorstore's driver_testutil): every registered driver runs the same
// checks on a sample checkpoint of its format. Each driver registers its
// sample in a <driver>_sample.cc beside this file; a driver without one
// fails the suite.

#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "engine/formats/driver.h"

namespace ucp::formats::conformance {

struct Sample {
  std::string driver;
  /// Makes a save folder of the format in `dir` (an empty folder the test
  /// owns) and returns it.
  std::function<std::filesystem::path(const std::filesystem::path& dir)> make;
  /// The target options of the sample's own layout, and of another one.
  TargetOptions same;
  TargetOptions other;
  /// Files under the checkpoint folder the same-layout rewrite does not
  /// reproduce as they are (names relative to the checkpoint folder, e.g.
  /// a script copied there, or an index naming the save); compared nowhere.
  std::vector<std::string> not_reproduced;
  /// The framework loads the format at any layout (Source::Fits is always
  /// true).
  bool loads_at_any_layout = false;
};

/// Registers a sample (at static initialisation).
bool RegisterSample(Sample sample);
const std::vector<Sample>& Samples();

}  // namespace ucp::formats::conformance
