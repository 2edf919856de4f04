"""Meshes and the α-β link model that prices every collective.

The cost of moving ``b`` bytes over mesh axis ``a`` is ``alpha[a] + b / beta[a]`` seconds.
Defaults are NVLink-class numbers; override them per axis (``LinkModel(beta={"data": 25e9})``)
for slower links, e.g. a data axis that crosses hosts.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Mapping

import jax
import numpy as np
from jax.sharding import Mesh

from shardflow.specs import ShardingError


def make_mesh(axes: Mapping[str, int], devices=None) -> Mesh:
    """``make_mesh({"data": 2, "model": 4})``: a Mesh over the first prod(sizes) devices."""
    names, sizes = tuple(axes), tuple(int(n) for n in axes.values())
    devices = list(jax.devices() if devices is None else devices)
    need = math.prod(sizes)
    if need > len(devices):
        raise ShardingError(f"mesh {dict(axes)} needs {need} devices, {len(devices)} are available")
    return Mesh(np.array(devices[:need]).reshape(sizes), names)


@dataclasses.dataclass(frozen=True)
class LinkModel:
    alpha: float = 5e-6          # seconds of latency per collective
    beta: float = 150e9          # bytes / second per device
    per_axis_alpha: Mapping[str, float] = dataclasses.field(default_factory=dict)
    per_axis_beta: Mapping[str, float] = dataclasses.field(default_factory=dict)

    def seconds(self, axes, nbytes: float) -> float:
        if nbytes == 0:
            return 0.0
        alpha = max((self.per_axis_alpha.get(a, self.alpha) for a in axes), default=self.alpha)
        beta = min((self.per_axis_beta.get(a, self.beta) for a in axes), default=self.beta)
        return alpha + nbytes / beta
