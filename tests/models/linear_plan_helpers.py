"""Helpers for tests and benches that run an existing PackedWeight on another plan
(linear_plan.py): a weight's plan is made once, with the weight, so patching what plan_for
reads afterwards (linear_plan.GEMV_X_FORMAT, the native flag, the panel kernels' flags) no
longer moves it. Both set the plan through `monkeypatch`, so a module's shared weights get
their own plans back after the test."""

from __future__ import annotations

import dataclasses

import pytest

from mrv2.models.layers import linear_plan, quantized
from mrv2.models.layers.quantized import PackedWeight


def made_now(weight: PackedWeight) -> linear_plan.LinearPlan:
    """The plan `weight` would get if it were made now, as PackedWeight.__init__ makes it
    (what plan_for reads as patched now), the panels' plan where it is held as its panels."""
    native = weight.is_half and quantized.computes_natively(weight.half_dtype)
    plan = linear_plan.plan_for(weight.layout, native)
    return linear_plan.panels_plan(plan) if weight.panel_storage else plan


def replan(monkeypatch: pytest.MonkeyPatch, weight: PackedWeight) -> None:
    """Run `weight` on `made_now(weight)` for this test."""
    monkeypatch.setattr(weight, "plan", made_now(weight))


def set_plan(monkeypatch: pytest.MonkeyPatch, weight: PackedWeight, **changes) -> None:
    """Run `weight` on its plan with `changes` (LinearPlan fields: few, few_rows, many,
    x_format) for this test."""
    monkeypatch.setattr(weight, "plan", dataclasses.replace(weight.plan, **changes))
