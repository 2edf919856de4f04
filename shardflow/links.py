"""The α-β link model that prices every collective (and a device's local work).

The cost of moving ``b`` bytes over mesh axis ``a`` is ``alpha[a] + b / beta[a]`` seconds.
Defaults are NVLink-class numbers; override them per axis (``LinkModel(beta={"data": 25e9})``)
for slower links, e.g. a data axis that crosses hosts. Local work — ``f`` flops reading and
writing ``b`` bytes of a device's memory — costs ``f / flops + b / memory_bandwidth`` (H100-class
defaults): the whole-program solver weighs running an equation whole against splitting it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping


@dataclasses.dataclass(frozen=True)
class LinkModel:
    alpha: float = 5e-6  # seconds of latency per collective
    beta: float = 150e9  # bytes / second per device
    per_axis_alpha: Mapping[str, float] = dataclasses.field(default_factory=dict)
    per_axis_beta: Mapping[str, float] = dataclasses.field(default_factory=dict)
    flops: float = 400e12  # a device's sustained matmul flop/s
    memory_bandwidth: float = 3e12  # bytes / second between a device and its memory

    def compute_seconds(self, flops: float, nbytes: float) -> float:
        return flops / self.flops + nbytes / self.memory_bandwidth

    def seconds(self, axes, nbytes: float) -> float:
        if nbytes == 0:
            return 0.0
        if not self.per_axis_alpha and not self.per_axis_beta:
            return self.alpha + nbytes / self.beta
        beta = min((self.per_axis_beta.get(a, self.beta) for a in axes), default=self.beta)
        return self.latency(axes) + nbytes / beta

    def latency(self, axes) -> float:
        """The α of ``seconds(axes, ...)``: what a collective over ``axes`` costs beyond its bytes."""
        return max((self.per_axis_alpha.get(a, self.alpha) for a in axes), default=self.alpha)
