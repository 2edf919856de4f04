"""shardflow: a compiler-style SPMD sharding framework on JAX.

    mesh = sf.make_mesh({"data": 2, "model": 4})
    step = sf.parallelize(train_step, mesh=mesh, in_specs=(param_specs, PartitionSpec("data")))
    print(step.explain(params, batch))      # every collective, its bytes and your source line
    params, loss = step(params, batch)
"""
from shardflow.specs import AUTO, B, P, S, Broadcast, Partial, ShardingError, Split, to_partition_spec, to_sbp
from shardflow.mesh import LinkModel, make_mesh
from shardflow.primitives import constrain
from shardflow import passes
from shardflow import schedules
from shardflow.pipelining import pipeline
from shardflow.api import parallelize, Parallelized, ReplicatedAxisWarning
from shardflow.explain import Plan, Collective
from shardflow.search import Alternative, Candidate, alternatives, plan

__all__ = ["AUTO", "B", "P", "S", "Broadcast", "Partial", "Split", "ShardingError", "to_partition_spec", "to_sbp",
           "LinkModel", "make_mesh", "constrain", "pipeline", "schedules", "passes", "parallelize", "Parallelized",
           "ReplicatedAxisWarning", "Plan", "Collective",
           "plan", "Candidate", "alternatives", "Alternative"]
__version__ = "0.1.0"
