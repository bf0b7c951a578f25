// The findings and layers panels.
#include <imgui.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <string>

#include "ampdiag/analyzer/escape.h"
#include "ampdiag/analyzer/render.h"
#include "app.h"
#include "style.h"

namespace ampdiag::gui {

void App::findings(float x, float y, float w, float h) {
  place("Findings", x, y, w, h);
  if (report_.findings.empty()) ImGui::TextColored(ImVec4(0.4f, 0.85f, 0.4f, 1), "Healthy: nothing found.");
  // The device profile (profile=True): ampdiag's own share and where device time goes.
  for (std::size_t i = 0; i < fp8_.size(); ++i) {
    const auto lines = analyzer::fp8_lines(fp8_[i]);
    if (lines.empty()) continue;
    ImGui::PushStyleColor(ImGuiCol_Text, ImGui::GetStyleColorVec4(ImGuiCol_TextDisabled));
    for (const auto& line : lines) ImGui::TextWrapped("%s", analyzer::printable(line).c_str());
    ImGui::PopStyleColor();
  }
  if (!whatif_.empty()) {
    // The same replay as `ampdiag whatif`: would another GradScaler setting skip less?
    ImGui::SetNextItemOpen(whatif_open_, ImGuiCond_Once);
    if (ImGui::TreeNode("whatif", "What-if: another loss scaler (ampdiag whatif)")) {
      for (const auto& line : whatif_) ImGui::TextWrapped("%s", analyzer::printable(line).c_str());
      ImGui::TreePop();
    }
  }
  for (const auto& run : report_.runs) {
    const auto lines = analyzer::device_profile_lines(run);
    if (lines.empty()) continue;
    ImGui::PushStyleColor(ImGuiCol_Text, ImGui::GetStyleColorVec4(ImGuiCol_TextDisabled));
    ImGui::TextWrapped("%s", analyzer::printable(lines.front()).c_str());
    ImGui::PopStyleColor();
    if (lines.size() > 1 && ImGui::TreeNode(&run, "device time by module (%zu)", lines.size() - 1)) {
      for (std::size_t i = 1; i < lines.size(); ++i) ImGui::TextDisabled("%s", analyzer::printable(lines[i]).c_str());
      ImGui::TreePop();
    }
  }
  int n = 0;
  for (const auto& f : report_.findings) {
    ImGui::PushID(n++);
    ImGui::TextColored(severity_colour(f.severity), "%s [%s]", analyzer::severity_name(f.severity), f.rule.c_str());
    if (!f.layer.empty()) {
      ImGui::SameLine();
      if (ImGui::SmallButton("Show")) select(f.layer, f.steps.empty() ? -1 : f.steps.front());
    }
    ImGui::TextWrapped("%s", analyzer::printable(f.title).c_str());
    ImGui::PushStyleColor(ImGuiCol_Text, ImGui::GetStyleColorVec4(ImGuiCol_TextDisabled));
    ImGui::TextWrapped("%s", analyzer::printable(f.evidence).c_str());
    ImGui::PopStyleColor();
    if (!f.suggestions.empty()) {
      const auto& s = f.suggestions.front();
      ImGui::TextWrapped("fix: %s", analyzer::printable(s.summary).c_str());
      if (!s.cost.empty()) ImGui::TextWrapped("cost: %s", analyzer::printable(s.cost).c_str());
      if (!s.python.empty() && ImGui::SmallButton("Copy Python")) ImGui::SetClipboardText(s.python.c_str());
      if (!s.cpp.empty()) {
        ImGui::SameLine();
        if (ImGui::SmallButton("Copy C++")) ImGui::SetClipboardText(s.cpp.c_str());
      }
    }
    ImGui::Separator();
    ImGui::PopID();
  }
  ImGui::End();
}

std::vector<const char*> App::layer_columns() const {
  std::vector<const char*> names = {"layer", "non-finite steps", "least headroom (bits)"};
  if (run().measured_updates()) names.push_back("updates rounded away");
  return names;
}

void App::layers(float x, float y, float w, float h) {
  place("Layers (culprits first)", x, y, w, h);
  const auto columns = layer_columns();
  const bool updates = run().measured_updates();
  if (ImGui::BeginTable("layers", int(columns.size()), ImGuiTableFlags_RowBg | ImGuiTableFlags_ScrollY | ImGuiTableFlags_Resizable)) {
    for (const char* name : columns) ImGui::TableSetupColumn(name);
    ImGui::TableHeadersRow();
    ImGuiListClipper clipper;
    clipper.Begin(int(ranked_.size()));
    while (clipper.Step())
      for (int i = clipper.DisplayStart; i < clipper.DisplayEnd; ++i) {
        const auto& r = ranked_[std::size_t(i)];
        ImGui::TableNextRow();
        ImGui::TableNextColumn();
        const std::string full = analyzer::printable(r.layer->info.name);
        const std::string shown = fit_end(full, ImGui::GetContentRegionAvail().x, text_width);
        if (ImGui::Selectable((shown + "###" + std::to_string(i)).c_str(), i == selected_, ImGuiSelectableFlags_SpanAllColumns))
          selected_ = i;
        if (shown != full && ImGui::IsItemHovered()) ImGui::SetTooltip("%s", full.c_str());
        ImGui::TableNextColumn();
        ImGui::Text("%lld", (long long)r.layer->nonfinite_steps);
        ImGui::TableNextColumn();
        if (std::isfinite(r.least_headroom)) ImGui::Text("%.1f", r.least_headroom);
        else ImGui::TextUnformatted(r.least_headroom < 0 ? "non-finite" : "-");
        if (!updates) continue;
        ImGui::TableNextColumn();
        if (std::isnan(r.stalled_updates)) ImGui::TextUnformatted("-");
        else ImGui::Text("%.1f %%", r.stalled_updates * 100);
      }
    ImGui::EndTable();
  }
  ImGui::End();
}

}  // namespace ampdiag::gui
