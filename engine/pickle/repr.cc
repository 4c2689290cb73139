// Repr(): Python-like rendering of a Value graph.

#include <algorithm>
#include <cstdint>
#include <string>
#include <unordered_set>

#include "engine/pickle/text.h"
#include "engine/pickle/value.h"

namespace ucp::pickle {
namespace {

// Containers nested deeper than this render as "...".
constexpr int kMaxReprDepth = 64;
// Ints longer than this many bytes render as "<int of N bytes>" (Python
// itself refuses to print ints of more than 4300 digits).
constexpr size_t kMaxIntReprBytes = 2048;

class ReprWriter {
 public:
  explicit ReprWriter(size_t max_len) : max_len_(max_len) {}

  std::string Finish() && {
    if (out_.size() > max_len_) {
      size_t cut = max_len_ >= 3 ? max_len_ - 3 : 0;
      // Do not split a UTF-8 sequence.
      while (cut > 0 &&
             (static_cast<unsigned char>(out_[cut]) & 0xc0) == 0x80) {
        --cut;
      }
      out_.resize(cut);
      out_ += std::string(max_len_ >= 3 ? 3 : max_len_, '.');
    }
    return std::move(out_);
  }

  void Write(const Value* v, int depth) {
    if (Full()) return;
    if (v == nullptr) {
      out_ += "<null>";
      return;
    }
    switch (v->kind) {
      case Kind::kNone:
        out_ += "None";
        return;
      case Kind::kBool:
        out_ += v->b ? "True" : "False";
        return;
      case Kind::kInt:
        if (v->big.empty()) {
          out_ += std::to_string(v->i);
        } else if (v->big.size() > kMaxIntReprBytes) {
          out_ += "<int of " + std::to_string(v->big.size()) + " bytes>";
        } else {
          out_ += internal::BigIntToDecimal(v->big);
        }
        return;
      case Kind::kFloat:
        out_ += internal::FloatRepr(v->f);
        return;
      case Kind::kStr:
        out_ += internal::StrRepr(Prefix(v->s));
        return;
      case Kind::kBytes:
        out_ += internal::BytesRepr(Prefix(v->s));
        return;
      case Kind::kByteArray:
        out_ += "bytearray(" + internal::BytesRepr(Prefix(v->s)) + ")";
        return;
      case Kind::kGlobal:
        out_ += "<global " + v->module + "." + v->name + ">";
        return;
      default:
        break;
    }
    if (active_.count(v) != 0) {
      out_ += v->kind == Kind::kList   ? "[...]"
              : v->kind == Kind::kDict ? "{...}"
                                       : "...";
      return;
    }
    if (depth >= kMaxReprDepth) {
      out_ += "...";
      return;
    }
    active_.insert(v);
    WriteContainer(v, depth + 1);
    active_.erase(v);
  }

 private:
  bool Full() const { return out_.size() > max_len_; }

  // Only the start of a long str/bytes can show within max_len: each code
  // point renders as at least one character and takes at most 4 bytes.
  std::string_view Prefix(const std::string& s) const {
    const size_t room = max_len_ - std::min(max_len_, out_.size());
    if (room > (SIZE_MAX - 64) / 4) return s;
    const size_t limit = 4 * room + 64;
    if (s.size() <= limit) return s;
    size_t cut = limit;
    while (cut > 0 && (static_cast<unsigned char>(s[cut]) & 0xc0) == 0x80) {
      --cut;
    }
    return std::string_view(s).substr(0, cut);
  }

  void Items(const std::vector<Value*>& items, int depth) {
    for (size_t k = 0; k < items.size() && !Full(); ++k) {
      if (k > 0) out_ += ", ";
      Write(items[k], depth);
    }
  }

  void Entries(const std::vector<std::pair<Value*, Value*>>& entries,
               int depth) {
    for (size_t k = 0; k < entries.size() && !Full(); ++k) {
      if (k > 0) out_ += ", ";
      Write(entries[k].first, depth);
      out_ += ": ";
      Write(entries[k].second, depth);
    }
  }

  void WriteContainer(const Value* v, int depth) {
    switch (v->kind) {
      case Kind::kTuple:
        out_ += '(';
        Items(v->items, depth);
        if (v->items.size() == 1) out_ += ',';
        out_ += ')';
        return;
      case Kind::kList:
        out_ += '[';
        Items(v->items, depth);
        out_ += ']';
        return;
      case Kind::kDict:
        out_ += '{';
        Entries(v->entries, depth);
        out_ += '}';
        return;
      case Kind::kSet:
        if (v->items.empty()) {
          out_ += "set()";
          return;
        }
        out_ += '{';
        Items(v->items, depth);
        out_ += '}';
        return;
      case Kind::kFrozenSet:
        out_ += "frozenset(";
        if (!v->items.empty()) {
          out_ += '{';
          Items(v->items, depth);
          out_ += '}';
        }
        out_ += ')';
        return;
      case Kind::kPersId:
        out_ += "persid(";
        Write(v->pid, depth);
        out_ += ')';
        return;
      case Kind::kObject:
        WriteObject(v, depth);
        return;
      default:
        out_ += "<?>";
        return;
    }
  }

  void WriteObject(const Value* v, int depth) {
    std::string cls = v->ClassName();
    if (cls.empty()) {
      out_ += "<object ";
      Write(v->callable, depth);
      out_ += ">";
    } else {
      out_ += cls;
    }
    out_ += '(';
    bool first = true;
    auto sep = [&] {
      if (!first) out_ += ", ";
      first = false;
    };
    const Value* state = v->state;
    if (!v->entries.empty() || v->IsDictLike()) {
      sep();
      out_ += '{';
      Entries(v->entries, depth);
      out_ += '}';
    } else if (state != nullptr && state->kind == Kind::kDict) {
      for (size_t k = 0; k < state->entries.size() && !Full(); ++k) {
        sep();
        const Value* key = state->entries[k].first;
        if (key != nullptr && key->kind == Kind::kStr) {
          out_ += key->s;
        } else {
          Write(key, depth);
        }
        out_ += '=';
        Write(state->entries[k].second, depth);
      }
      state = nullptr;
    } else if (v->args != nullptr && v->args->kind == Kind::kTuple) {
      for (size_t k = 0; k < v->args->items.size() && !Full(); ++k) {
        sep();
        Write(v->args->items[k], depth);
      }
    }
    if (!v->items.empty() && !Full()) {
      sep();
      out_ += '[';
      Items(v->items, depth);
      out_ += ']';
    }
    if (state != nullptr && !Full()) {
      sep();
      out_ += "state=";
      Write(state, depth);
    }
    out_ += ')';
  }

  size_t max_len_;
  std::string out_;
  std::unordered_set<const Value*> active_;
};

}  // namespace

std::string Repr(const Value* v, size_t max_len) {
  ReprWriter writer(max_len);
  writer.Write(v, 0);
  return std::move(writer).Finish();
}

}  // namespace ucp::pickle
