// What the C++ Agent hands its session, apart from the training's tensors: its options
// checked and translated, the run's and layers' descriptions, and the text of the
// exception that stopped a loop (Agent::training_raised()).
#pragma once

#include <ATen/core/Tensor.h>

#include <exception>
#include <string>

#include "ampdiag/agent.h"
#include "session.h"

namespace ampdiag::agent {

// Throws std::invalid_argument naming the option that is out of range.
SessionOptions session_options(const AgentOptions& options);

// "torch::nn::LinearImpl" -> "Linear"; user modules keep their own name.
std::string module_type_name(const torch::nn::Module& module);

// As torch names a dtype in Python, as the Python agent writes it: "float16", not c10's "Half".
std::string dtype_name(at::ScalarType type);

LayerInfo layer_info(const at::Tensor& parameter);

// This process's command line, its arguments joined by spaces.
std::string command_line();

// "Type: first line of the message", as the Python agent writes a raised exception.
std::string raised_text(const std::exception& error);

}  // namespace ampdiag::agent
