#pragma once
// The one exception hierarchy of ucp.
//
// Every public function of the engine throws only ucp::Error subclasses.
// Foreign exceptions (c10::Error, HDF5 error stacks, nlohmann::json, yaml-cpp,
// Boost.Program_options) are translated in the one module that touches that
// library. Each layer adds one phrase of context, so a message reads
//   rank file a/mp_rank_01/model_optim_rng.pt > param layers.3.mlp.fc1.weight >
//   exp_avg: <what>
// The subclasses are split by what the user can do about the failure; the CLI
// maps each to its own exit code (ExitCode()).

#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>

namespace ucp {

/// Concatenates the stream representation of all arguments.
template <typename... Args>
std::string StrCat(Args&&... args) {
  std::ostringstream out;
  (out << ... << std::forward<Args>(args));
  return out.str();
}

class Error : public std::runtime_error {
 public:
  template <typename... Args>
  explicit Error(Args&&... args)
      : std::runtime_error(""), message_(StrCat(std::forward<Args>(args)...)) {
    Rebuild();
  }

  /// Prepends one phrase of context ("rank file X", "param Y"). Returns *this
  /// so that `catch (Error& e) { e.AddContext(...); throw; }` reads naturally.
  template <typename... Args>
  Error& AddContext(Args&&... args) {
    context_.insert(0, StrCat(std::forward<Args>(args)..., " > "));
    Rebuild();
    return *this;
  }

  const char* what() const noexcept override { return full_.c_str(); }
  /// The innermost message without context.
  const std::string& message() const noexcept { return message_; }
  /// "format error", "layout error", ... used as the CLI's line prefix.
  virtual const char* kind() const noexcept { return "error"; }
  /// Process exit code the CLI uses for this class of failure.
  virtual int ExitCode() const noexcept { return 1; }

 private:
  // A NUL byte (from a corrupt name in a file) would cut what() short, and
  // with it the file name the context carries: it is spelled out.
  void Rebuild() {
    full_ = context_ + message_;
    for (size_t at = full_.find('\0'); at != std::string::npos;
         at = full_.find('\0', at + 4)) {
      full_.replace(at, 1, "\\x00");
    }
  }
  std::string message_;
  std::string context_;
  std::string full_;
};

/// Input is corrupt, truncated or in an unsupported format.
class FormatError : public Error {
 public:
  using Error::Error;
  const char* kind() const noexcept override { return "format error"; }
  int ExitCode() const noexcept override { return 3; }
};

/// A layout descriptor is invalid or does not fit the checkpoint / topology.
class LayoutError : public Error {
 public:
  using Error::Error;
  const char* kind() const noexcept override { return "layout error"; }
  int ExitCode() const noexcept override { return 4; }
};

/// Filesystem, HDF5 or short read/write failure.
class IoError : public Error {
 public:
  using Error::Error;
  const char* kind() const noexcept override { return "i/o error"; }
  int ExitCode() const noexcept override { return 5; }
};

/// Bad command line or configuration.
class UsageError : public Error {
 public:
  using Error::Error;
  const char* kind() const noexcept override { return "usage error"; }
  int ExitCode() const noexcept override { return 2; }
};

/// A broken invariant: a bug in ucp (raised by UCP_CHECK).
class InternalError : public Error {
 public:
  using Error::Error;
  const char* kind() const noexcept override { return "internal error"; }
  int ExitCode() const noexcept override { return 70; }
};

}  // namespace ucp

/// Throws InternalError if `cond` is false. For invariants, not for bad input.
#define UCP_CHECK(cond, ...)                                                   \
  do {                                                                         \
    if (!(cond)) {                                                             \
      throw ::ucp::InternalError("check failed at ", __FILE__, ":", __LINE__,  \
                                 ": ", #cond __VA_OPT__(, " ", ) __VA_ARGS__); \
    }                                                                          \
  } while (false)
