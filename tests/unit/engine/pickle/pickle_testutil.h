#pragma once
// Helpers for the pickle tests: spelling opcode streams by hand and asking
// CPython (the oracle) about pickles.

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace ucp::pickle::testing {

/// The bytes of a string literal, embedded NULs included (the literal's own
/// terminator excluded).
template <size_t N>
std::string Bin(const char (&s)[N]) {
  return std::string(s, N - 1);
}

/// `n` little-endian bytes of `v`.
std::string LE(uint64_t v, int n);

/// PROTO n.
std::string Proto(int n);
/// BINUNICODE s.
std::string BinUnicode(std::string_view s);
/// GLOBAL 'module name'.
std::string Global(std::string_view module, std::string_view name);
/// BINPUT i / BINGET i.
std::string BinPut(uint8_t i);
std::string BinGet(uint8_t i);

/// tests/tools/<name> in the source tree.
std::filesystem::path ToolPath(std::string_view name);

/// Runs tests/tools/check_pickle_roundtrip.py on (original, rewritten) pairs
/// of files; returns "" when CPython loads every pair to equal objects, else
/// the script's output.
std::string CheckRoundTrip(
    const std::vector<std::pair<std::filesystem::path, std::filesystem::path>>&
        pairs);

/// Loads `pickle_bytes` with CPython and compares the object with the Python
/// expression `expected` (evaluated with the corpus stubs importable, after
/// `imports`) using check_pickle_roundtrip.equal. Returns "" if equal, else
/// the explanation or error output.
std::string PythonLoadsAs(const std::string& pickle_bytes,
                          const std::string& expected,
                          const std::string& imports = "");

/// What CPython's pickle.dumps(<expr>, protocol=2) writes, evaluated after
/// `imports` with the corpus stubs importable. Fails the test (and returns
/// "") if Python fails.
std::string CPythonPickle(const std::string& expr,
                          const std::string& imports = "");

}  // namespace ucp::pickle::testing
