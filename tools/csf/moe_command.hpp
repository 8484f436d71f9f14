// `csf moe`: run one fused MoE layer (synthetic weights of a real geometry)
// on the GPU when one is present, else on the CPU reference, and print the
// time per call and the error against the reference.
#pragma once

#include <CLI/CLI.hpp>

namespace csfmoe::cli {

// Adds the `moe` sub-command to app; it runs from its own callback and ends
// the process with its exit code (0 ok, 1 error, 3 error above --max-error).
void register_moe_command(CLI::App& app);

}  // namespace csfmoe::cli
