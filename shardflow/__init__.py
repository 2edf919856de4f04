"""shardflow: a compiler-style SPMD sharding framework on JAX.

mesh = sf.make_mesh({"data": 2, "model": 4})
step = sf.parallelize(train_step, mesh=mesh, in_specs=(param_specs, PartitionSpec("data")))
print(step.explain(params, batch))      # every collective, its bytes and your source line
params, loss = step(params, batch)
"""

from shardflow import passes, schedules
from shardflow.api import Parallelized, ReplicatedAxisWarning, parallelize
from shardflow.costs import Collective
from shardflow.explain import Plan
from shardflow.links import LinkModel
from shardflow.mesh import make_mesh
from shardflow.pipelining import pipeline
from shardflow.predication import predicated
from shardflow.primitives import constrain
from shardflow.search import Alternative, Candidate, alternatives, plan
from shardflow.specs import AUTO, B, Broadcast, P, Partial, S, ShardingError, Split, to_partition_spec, to_sbp

__all__ = [
    "AUTO",
    "B",
    "P",
    "S",
    "Broadcast",
    "Partial",
    "Split",
    "ShardingError",
    "to_partition_spec",
    "to_sbp",
    "LinkModel",
    "make_mesh",
    "constrain",
    "pipeline",
    "predicated",
    "schedules",
    "passes",
    "parallelize",
    "Parallelized",
    "ReplicatedAxisWarning",
    "Plan",
    "Collective",
    "plan",
    "Candidate",
    "alternatives",
    "Alternative",
]
__version__ = "0.1.0"
