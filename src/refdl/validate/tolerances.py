"""The tolerances of an exact comparison with a framework: what fp32 and fp64 rounding
move a run by (light: the command line quotes them before anything heavy loads)."""

from __future__ import annotations

# fp32 tolerances (docs/validation.md). Two tight checks hold for
# every model: the first step's loss (the forward pass) and the parameters after the
# first update (backward pass and optimizer) agree to FIRST_STEP_RTOL. Over N steps,
# rounding differences grow with the model's sensitivity, so the trajectory's
# tolerances (parameters' relative L2, per-step loss) are per model, set above the
# differences measured over 20 steps: mlp/lenet5 ~5e-8; transformer (Adam) 2.4e-6;
# lstm_lm (Adam) 1.3e-4 (the
# same distance refdl keeps from a float64 run); resnet 2e-2 (ResNet-20 with BatchNorm
# at lr 0.05 amplifies a 1e-7 difference ~1.8x per step: float32 PyTorch and refdl
# each drift from float64 PyTorch by 1e-3 and 2e-2 by step 20).
FIRST_STEP_RTOL = 1e-5
PARAM_RTOL = {"mlp": 1e-4, "lenet5": 1e-4, "lstm_lm": 1e-3, "transformer": 1e-4, "resnet": 1e-1,
              "moe": 1e-4}  # fmt: skip
LOSS_RTOL = {"mlp": 1e-4, "lenet5": 1e-4, "lstm_lm": 1e-3, "transformer": 1e-4, "resnet": 0.25,
             "moe": 1e-4}  # fmt: skip
# fp64 (``--precision fp64``): both sides in float64, so rounding moves a result by ~1e-16
# a step and 20 steps stay below 1e-11 for every model (docs/validation.md's table); one
# tolerance for all, 1e-9, still 10^6 below the smallest real bug the plants make.
FP64_RTOL = 1e-9
