// An RGBA texture that a panel paints on the CPU and ImGui draws as one quad: the heatmap's
// cells cost one upload a frame instead of thousands of rectangles for the rasteriser
// (llvmpipe draws a rectangle's two triangles slower than we fill its pixels).
#pragma once

#include <imgui.h>

#include <cstdint>
#include <vector>

namespace ampdiag::gui {

class RgbaTexture {
 public:
  RgbaTexture() = default;
  ~RgbaTexture();
  RgbaTexture(const RgbaTexture&) = delete;
  RgbaTexture& operator=(const RgbaTexture&) = delete;

  // Pixels as ImGui colours (IM_COL32: R in the lowest byte), `width` x `height`, top row
  // first. Needs the window's OpenGL context to be current.
  void upload(const std::vector<ImU32>& pixels, int width, int height);
  ImTextureID id() const { return reinterpret_cast<ImTextureID>(static_cast<std::intptr_t>(texture_)); }

 private:
  unsigned texture_ = 0;
  int width_ = 0, height_ = 0;
};

}  // namespace ampdiag::gui
