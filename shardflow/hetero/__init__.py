"""Heterogeneous clusters: a device catalogue, cluster descriptions, a simulator of a training
step's time and memory under a plan of pipelines over mixed device kinds, and a search over
such plans.

Plans run through ``shardflow train`` (its ``cluster:`` key): uneven micro-batch counts per
data replica as one SPMD program (padding skipped by predication without a pipeline, computed
under one), uneven layers per stage. The simulator's fit to published measurements and to our
own runs is in benchmarks/results/hetero.md."""

from shardflow.hetero.cluster import Cluster, Node
from shardflow.hetero.devices import CATALOGUE, DeviceKind, device_kind
from shardflow.hetero.search import search
from shardflow.hetero.simulate import Framework, Pipeline, Plan, Prediction, Stage, Transformer, simulate, uniform_plan

__all__ = [
    "CATALOGUE",
    "Cluster",
    "DeviceKind",
    "Framework",
    "Node",
    "Pipeline",
    "Plan",
    "Prediction",
    "Stage",
    "Transformer",
    "device_kind",
    "search",
    "simulate",
    "uniform_plan",
]
