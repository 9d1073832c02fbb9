// Graph-side entry point of the gated activation op (see act_op.cpp).
#pragma once

#include <optional>

#include "mlx/array.h"

namespace act {

// act(gate) * up, elementwise, float32 on the CPU: act 0 = SiLU (mlx.nn.silu), 1 = GELU
// with the tanh approximation (mlx.nn.gelu_approx). None when the op does not serve these
// inputs (another dtype or device, shapes that differ).
std::optional<mlx::core::array> gated(const mlx::core::array& gate, const mlx::core::array& up, int act);

}  // namespace act
