"""click parameter types shared by the stage commands."""

from __future__ import annotations

import math

import click


class FiniteFloat(click.FloatRange):
    """A float range that also refuses nan and ±inf (click's FloatRange lets nan through: every comparison with it
    is false)."""

    name = "finite float"

    def convert(self, value, param, ctx):
        v = super().convert(value, param, ctx)
        if not math.isfinite(v):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return v


SEED = click.IntRange(0, 2**63 - 1)
