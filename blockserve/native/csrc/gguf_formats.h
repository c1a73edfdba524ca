// The GGUF block formats the block kernels read (gguf_blocks.cpp, gguf_blocks_int8.cpp), by name.
// Each kernel file has a struct per format and a Format (its own table of entry points) made from it:
//
//   gguf_format_named<Format, Q4_0, Q4_1, ...>(name, kernel, make)
//       make(FormatTag<F>{}) for the struct F in the place `name` has in kGgufFormatNames (the
//       structs given in that order), or an error naming `kernel` and the formats it reads.
#pragma once

#include <c10/util/Exception.h>

#include <array>
#include <cstddef>
#include <string>

namespace blockserve {

inline constexpr std::array<const char*, 12> kGgufFormatNames = {
    "Q4_0", "Q4_1", "Q8_0", "Q5_0", "Q5_1", "IQ4_NL", "Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS"};

template <typename F>
struct FormatTag {
  using type = F;
};

template <typename Format, typename... F, typename Make>
Format gguf_format_named(const std::string& name, const char* kernel, Make make) {
  static_assert(sizeof...(F) == kGgufFormatNames.size(), "one struct per format name, in their order");
  Format found{};
  bool hit = false;
  std::size_t i = 0;
  ((hit || name != kGgufFormatNames[i++] ? void() : (found = make(FormatTag<F>{}), hit = true, void())), ...);
  if (!hit) {
    std::string read;
    for (const char* format : kGgufFormatNames) read += (read.empty() ? "" : ", ") + std::string(format);
    TORCH_CHECK(false, kernel, ": no kernel for GGUF format ", name, " (read: ", read, ")");
  }
  return found;
}

}  // namespace blockserve
