"""``python -m simdist.plan``: the command-line entry of plan mode.

The planner lives in ``simdist.sim.plan`` (formulas and rules in its docstring), next to the
step-time model it shares with a run (``simdist.sim.step``); this module keeps the command
and the import path ``simdist.plan`` that scripts and tests use.
"""

from __future__ import annotations

import sys

from simdist.sim.plan import (
    PlanConfig,
    Planner,
    PlanResult,
    build_parser,
    format_plan,
    main,
    plan,
)
from simdist.sim.plan_analytic import DDP_BUCKET_BYTES, Op, transformer_layer_ops
from simdist.sim.plan_shapes import (
    MODELS,
    CountSpec,
    MLPSpec,
    TransformerSpec,
    layer_activation_bytes,
    model_state_bytes,
)

__all__ = [
    "DDP_BUCKET_BYTES",
    "MODELS",
    "CountSpec",
    "MLPSpec",
    "Op",
    "PlanConfig",
    "PlanResult",
    "Planner",
    "TransformerSpec",
    "build_parser",
    "format_plan",
    "layer_activation_bytes",
    "main",
    "model_state_bytes",
    "plan",
    "transformer_layer_ops",
]

if __name__ == "__main__":
    sys.exit(main())
