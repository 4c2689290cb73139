#pragma once
// Reading the pickled values of DeepSpeed files: small typed accessors that
// throw FormatError naming the key.

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "engine/core/strided.h"
#include "engine/pickle/value.h"

namespace ucp::deepspeed::internal {

/// d[key] of a dict-like; nullptr if absent or `d` is not dict-like.
const pickle::Value* Get(const pickle::Value* d, std::string_view key);
/// Throws FormatError "no 'key'" if absent.
const pickle::Value* Require(const pickle::Value* d, std::string_view key);
/// Require, and the value is a dict. Throws FormatError.
const pickle::Value* RequireDict(const pickle::Value* d, std::string_view key);
/// An int (or bool). Throws FormatError naming `what`.
int64_t Int(const pickle::Value* v, std::string_view what);
/// A str. Throws FormatError naming `what`.
std::string Str(const pickle::Value* v, std::string_view what);
/// True for None or absence.
bool IsNone(const pickle::Value* v);
/// The str keys of a dict-like in order. Throws FormatError if a key is not
/// a str.
std::vector<std::string> Keys(const pickle::Value* d, std::string_view what);
/// A torch.Size (or tuple / list of ints). Throws FormatError.
Shape SizeOf(const pickle::Value* v, std::string_view what);
/// List or tuple items. Throws FormatError.
const std::vector<pickle::Value*>& Items(const pickle::Value* v,
                                         std::string_view what);
/// The value of a pickled ZeroStageEnum member (getattr(ZeroStageEnum,
/// 'gradients'), ZeroStageEnum(2)) or a plain int; absent for anything else.
std::optional<int64_t> ZeroStageOf(const pickle::Value* v);
/// d[int key] of a dict (torch optimizer state); nullptr if absent.
const pickle::Value* GetIndex(const pickle::Value* d, int64_t key);

}  // namespace ucp::deepspeed::internal
