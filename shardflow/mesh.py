"""Device meshes: `make_mesh` builds one from named axis sizes, `check_mesh` vets a user's."""

from __future__ import annotations

import math
from collections.abc import Mapping

import jax
import numpy as np
from jax.sharding import Mesh

from shardflow.specs import ShardingError


def make_mesh(axes: Mapping[str, int], devices=None) -> Mesh:
    """``make_mesh({"data": 2, "model": 4})``: a Mesh over the first prod(sizes) devices.

    ``axes`` maps each mesh axis name (a string) to its size (a positive int), in mesh order;
    a sequence of ``(name, size)`` pairs is read the same way.
    """
    names, sizes = _axes(axes)
    devices = list(jax.devices() if devices is None else devices)
    need = math.prod(sizes)
    if need > len(devices):
        have = f"{len(devices)} {'is' if len(devices) == 1 else 'are'} available"
        raise ShardingError(
            f"make_mesh({axes!r}): needs {need} devices, {have}"
            + (_SIMULATED.format(n=need) if all(d.platform == "cpu" for d in devices) else "")
        )
    return Mesh(np.array(devices[:need]).reshape(sizes), names)


_SIMULATED = (
    "; on CPU, simulate {n} devices with jax.config.update('jax_num_cpu_devices', {n}) right after "
    "importing jax, before any JAX work, or XLA_FLAGS=--xla_force_host_platform_device_count={n} set "
    "before importing jax"
)


_EXAMPLE = "sf.make_mesh({'data': 2, 'model': 4})"


def _axes(axes) -> tuple[tuple, tuple]:
    """(names, sizes) of make_mesh's argument, or a ShardingError that says what is wrong."""
    if isinstance(axes, Mesh):
        raise ShardingError(
            f"make_mesh(Mesh{dict(zip(axes.axis_names, axes.devices.shape))}): this is "
            "already a Mesh; pass it to sf.parallelize(mesh=...) as it is"
        )
    if isinstance(axes, Mapping):
        pairs = list(axes.items())
    elif isinstance(axes, (list, tuple)) and all(isinstance(p, (list, tuple)) and len(p) == 2 for p in axes):
        pairs = [tuple(p) for p in axes]
    else:
        raise ShardingError(f"make_mesh({axes!r}): expected a dict of mesh axis name -> size, e.g. {_EXAMPLE}")
    call = f"make_mesh({axes!r})"
    if not pairs:
        raise ShardingError(f"{call}: a mesh needs at least one axis, e.g. {_EXAMPLE}")
    names = [n for n, _ in pairs]
    for name, size in pairs:
        _check_axis(name, size, call)
        if names.count(name) > 1:
            raise ShardingError(
                f"{call}: mesh axis {name!r} is named {names.count(name)} times; each mesh axis needs its own name"
            )
    return tuple(names), tuple(int(size) for _, size in pairs)


def _check_axis(name, size, where: str) -> None:
    if not isinstance(name, str) or not name:
        raise ShardingError(
            f"{where}: mesh axis name {name!r} is not a non-empty string; specs name mesh "
            f"axes by string (PartitionSpec('data')), e.g. {_EXAMPLE}"
        )
    if isinstance(size, (bool, np.bool_)) or not isinstance(size, (int, np.integer)) or size < 1:
        raise ShardingError(
            f"{where}: mesh axis {name!r} has size {size!r}; a mesh axis size is a positive "
            f"int (the number of devices along it)"
        )


def check_mesh(mesh, where: str) -> Mesh:
    """``mesh`` if it is a Mesh shardflow can run on, else a ShardingError naming ``where`` (the
    user's function) that says how to make one."""
    if isinstance(mesh, Mesh):
        names = tuple(mesh.axis_names)
        for name, size in zip(names, mesh.devices.shape):
            _check_axis(name, size, f"mesh= of {where}")
            if names.count(name) > 1:
                raise ShardingError(
                    f"mesh= of {where}: mesh axis {name!r} is named {names.count(name)} times in "
                    f"{names}; each mesh axis needs its own name, e.g. {_EXAMPLE}"
                )
        return mesh
    if isinstance(mesh, Mapping):
        how = f"make one with sf.make_mesh({dict(mesh)!r})"
    else:
        how = f"make one with {_EXAMPLE}"
    raise ShardingError(f"mesh={mesh!r} of {where} is a {type(mesh).__name__}, not a jax.sharding.Mesh; {how}")
