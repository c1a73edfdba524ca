// exp(x) for float32 to ~2 ulp (Cephes' expf polynomial on x = k ln2 + r), written so that the
// compiler vectorises loops of it; std::exp is a scalar call. Inputs are clamped to [-87, 88]:
// below, the result is ~1e-38 instead of a denormal or 0; above, it would overflow anyway.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

static inline float fast_exp(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float k = std::nearbyint(x * 1.44269504088896341f);  // (floor(. + 0.5) defeats gcc here: 10x slower)
  const float r = x - k * 0.693359375f + k * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(k) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}
