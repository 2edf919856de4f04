"""The rules of every primitive shardflow partitions, by family; importing this registers them
in ``shardflow.registry.RULES``. Scalars (rank-0 operands, literals) are always B. ``P`` flows
only through ops linear in it (add/sub of partials, negation, casts, reductions, dot_general
with a B partner, reshapes); everything else needs the partial value reduced first."""

from shardflow.rules import contraction, control, conv, elementwise, indexing, random, shape  # noqa: F401
