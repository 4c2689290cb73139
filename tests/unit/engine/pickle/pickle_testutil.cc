#include "tests/unit/engine/pickle/pickle_testutil.h"

#include <gtest/gtest.h>

#include <sstream>

#include "tests/testutil/testutil.h"

namespace ucp::pickle::testing {

std::string LE(uint64_t v, int n) {
  std::string out;
  for (int k = 0; k < n; ++k) out += static_cast<char>((v >> (8 * k)) & 0xff);
  return out;
}

std::string Proto(int n) {
  return std::string("\x80", 1) + static_cast<char>(n);
}

std::string BinUnicode(std::string_view s) {
  return "X" + LE(s.size(), 4) + std::string(s);
}

std::string Global(std::string_view module, std::string_view name) {
  return "c" + std::string(module) + "\n" + std::string(name) + "\n";
}

std::string BinPut(uint8_t i) { return "q" + LE(i, 1); }
std::string BinGet(uint8_t i) { return "h" + LE(i, 1); }

std::filesystem::path ToolPath(std::string_view name) {
  return testutil::SourceDir() / "tests" / "tools" / name;
}

std::string CheckRoundTrip(
    const std::vector<std::pair<std::filesystem::path, std::filesystem::path>>&
        pairs) {
  std::string command =
      testutil::ShellQuote(testutil::Python()) + " " +
      testutil::ShellQuote(ToolPath("check_pickle_roundtrip.py").string());
  for (const auto& [a, b] : pairs) {
    command += " " + testutil::ShellQuote(a.string()) + " " +
               testutil::ShellQuote(b.string());
  }
  std::string output;
  const int status = testutil::RunCommand(command, &output);
  return status == 0 ? "" : "exit " + std::to_string(status) + ": " + output;
}

std::string PythonLoadsAs(const std::string& pickle_bytes,
                          const std::string& expected,
                          const std::string& imports) {
  testutil::TempDir tmp;
  testutil::WriteFile(tmp / "p.pkl", pickle_bytes);
  std::ostringstream script;
  script << "import sys, pickle\n"
         << "sys.path.insert(0, sys.argv[2])\n"
         << "import check_pickle_roundtrip as rt\n"
         << imports << "\n"
         << "with open(sys.argv[1], 'rb') as f:\n"
         << "    got = pickle.load(f)\n"
         << "expected = " << expected << "\n"
         << "why = rt.explain(got, expected)\n"
         << "if why is not None:\n"
         << "    print('got %r: %s' % (got, why))\n"
         << "    sys.exit(1)\n";
  testutil::WriteFile(tmp / "check.py", script.str());
  std::string output;
  const int status = testutil::RunCommand(
      testutil::ShellQuote(testutil::Python()) + " " +
          testutil::ShellQuote((tmp / "check.py").string()) + " " +
          testutil::ShellQuote((tmp / "p.pkl").string()) + " " +
          testutil::ShellQuote(ToolPath("").string()),
      &output);
  return status == 0 ? "" : output.empty() ? "python failed" : output;
}

std::string CPythonPickle(const std::string& expr, const std::string& imports) {
  testutil::TempDir tmp;
  std::ostringstream script;
  script << "import sys, pickle\n"
         << "sys.path.insert(0, sys.argv[2])\n"
         << imports << "\nobj = " << expr << "\n"
         << "with open(sys.argv[1], 'wb') as f:\n"
         << "    f.write(pickle.dumps(obj, protocol=2))\n";
  testutil::WriteFile(tmp / "make.py", script.str());
  std::string output;
  const int status = testutil::RunCommand(
      testutil::ShellQuote(testutil::Python()) + " " +
          testutil::ShellQuote((tmp / "make.py").string()) + " " +
          testutil::ShellQuote((tmp / "out.pkl").string()) + " " +
          testutil::ShellQuote(ToolPath("stubs").string()),
      &output);
  if (status != 0) {
    ADD_FAILURE() << "python failed on " << expr << ": " << output;
    return "";
  }
  return testutil::ReadFile(tmp / "out.pkl");
}

}  // namespace ucp::pickle::testing
