// A name cut to a width, keeping its end: in a model's dotted paths the end tells the rows
// apart ("encoder.block.0.layer.0.SelfAttention.q.weight" and "...k.weight" share a long start).
#pragma once

#include <functional>
#include <string>

namespace ampdiag::gui {

// `text` where measure(text) fits `width`; else "..." and the longest end of `text` with
// which it fits; "" where not even "..." fits. `measure` grows with the text's length.
std::string fit_end(const std::string& text, float width, const std::function<float(const std::string&)>& measure);

}  // namespace ampdiag::gui
