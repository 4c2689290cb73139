// RecordReader (engine/universal/extras.h): typed getters over a driver's
// extras record, written here by hand, with required / optional members,
// the unknown members kept in order, and errors naming file, record, key.

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "engine/core/error.h"
#include "engine/universal/extras.h"
#include "engine/universal/model.h"

namespace ucp::universal {
namespace {

using ::testing::AllOf;
using ::testing::HasSubstr;
using ::testing::ThrowsMessage;

Model WithRecord(const char* text) {
  Model m;
  m.extras["rec"] = json::Value::Parse(text);
  return m;
}

constexpr char kRecord[] =
    R"({"z_unknown":[1,"a"],"name":"n","count":7,"ratio":0.5,"flag":true,)"
    R"("list":["a","b"],"nested":{"k":3,"extra":"e"},"a_unknown":null})";

TEST(RecordReaderTest, TypedMembersAndTheRestInOrder) {
  const Model m = WithRecord(kRecord);
  std::optional<RecordReader> r = RecordReader::ForExtras(m, "rec", "u.h5");
  ASSERT_TRUE(r.has_value());
  std::string name;
  int64_t count = 0;
  double ratio = 0;
  bool flag = false;
  std::vector<std::string> list;
  EXPECT_TRUE(r->Get("name", name));
  EXPECT_TRUE(r->Get("count", count));
  EXPECT_TRUE(r->Get("ratio", ratio, /*required=*/false));
  EXPECT_TRUE(r->Get("flag", flag));
  EXPECT_TRUE(r->Get("list", list));
  EXPECT_EQ(name, "n");
  EXPECT_EQ(count, 7);
  EXPECT_EQ(ratio, 0.5);
  EXPECT_TRUE(flag);
  EXPECT_EQ(list, (std::vector<std::string>{"a", "b"}));
  // Absent and allowed: false, the output untouched; an optional stays empty.
  std::string absent = "kept";
  EXPECT_FALSE(r->Get("absent", absent, /*required=*/false));
  EXPECT_EQ(absent, "kept");
  std::optional<int64_t> opt;
  EXPECT_FALSE(r->Get("absent_too", opt));
  EXPECT_FALSE(opt.has_value());
  int64_t k = 0;
  json::Value nested_rest;
  EXPECT_TRUE(r->Object("nested", true, [&](RecordReader& n) {
    n.Get("k", k);
    nested_rest = n.Rest();
  }));
  EXPECT_EQ(k, 3);
  EXPECT_EQ(nested_rest.Dump(), R"({"extra":"e"})");
  // The members no getter took, in the record's order.
  EXPECT_EQ(r->Rest().Dump(), R"({"z_unknown":[1,"a"],"a_unknown":null})");
  // No record: absent, not an error.
  EXPECT_FALSE(RecordReader::ForExtras(Model{}, "rec", "u.h5").has_value());
}

TEST(RecordReaderTest, ErrorsNameFileRecordAndKey) {
  const Model m = WithRecord(kRecord);
  auto reader = [&] { return *RecordReader::ForExtras(m, "rec", "bad.h5"); };
  EXPECT_THAT(
      [&] {
        std::string s;
        reader().Get("missing", s);
      },
      ThrowsMessage<FormatError>(
          AllOf(HasSubstr("universal file bad.h5 > attribute rec"),
                HasSubstr("missing key \"missing\""))));
  EXPECT_THAT(
      [&] {
        int64_t v = 0;
        reader().Get("name", v, /*required=*/false);  // a string
      },
      ThrowsMessage<FormatError>(
          HasSubstr("universal file bad.h5 > attribute rec > member name > ")));
  EXPECT_THAT(
      [&] {
        std::vector<std::string> v;
        reader().Get("z_unknown", v);  // [1, "a"]
      },
      ThrowsMessage<FormatError>(
          HasSubstr("attribute rec > member z_unknown")));
  EXPECT_THAT(
      [&] {
        reader().Object("nested", true, [](RecordReader& n) {
          std::string s;
          n.Get("k", s);  // an int
        });
      },
      ThrowsMessage<FormatError>(
          HasSubstr("attribute rec > member nested > member k > ")));
  EXPECT_THAT(
      [&] {
        reader().Object("nested", true, [](RecordReader& n) {
          bool b = false;
          n.Get("gone", b);
        });
      },
      ThrowsMessage<FormatError>(AllOf(HasSubstr("member nested"),
                                       HasSubstr("missing key \"gone\""))));
  EXPECT_THAT(
      [&] {
        reader().Object("name", true, [](RecordReader&) {});  // a string
      },
      ThrowsMessage<FormatError>(HasSubstr("member name > not a JSON object")));
  EXPECT_THAT([] { RecordReader::ForExtras(WithRecord("[1]"), "rec", "b.h5"); },
              ThrowsMessage<FormatError>(HasSubstr(
                  "universal file b.h5 > attribute rec > not a JSON object")));
}

TEST(RecordReaderTest, PutOpaqueAppendsAndRefusesATypedName) {
  json::Value out = json::Value::Object();
  out["typed"] = 1;
  PutOpaque(out, json::Value::Parse(R"({"b":2,"a":3})"));
  EXPECT_EQ(out.Dump(), R"({"typed":1,"b":2,"a":3})");
  PutOpaque(out, json::Value());  // null: nothing
  EXPECT_EQ(out.size(), 3u);
  EXPECT_THROW(PutOpaque(out, json::Value::Parse(R"({"typed":0})")),
               InternalError);
}

}  // namespace
}  // namespace ucp::universal
