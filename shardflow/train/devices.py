"""The devices a run sees: simulated CPU devices on a CPU-only machine, and
jax.distributed started where the environment describes a multi-process job."""

from __future__ import annotations

import importlib.util
import os

from shardflow._compat import backends_are_initialized

SIMULATED_CPU_DEVICES = 8


def configure_host_platform(n_devices: int = SIMULATED_CPU_DEVICES) -> None:
    """On a CPU-only machine, simulate n devices, unless the user has chosen a count.

    XLA reads this flag when JAX first creates its backends, so this must run before anything
    asks JAX for devices; once backends exist it changes nothing.
    """
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" in flags or not _platform_is_cpu() or backends_are_initialized():
        return
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n_devices}".strip()


def _platform_is_cpu() -> bool:
    chosen = os.environ.get("JAX_PLATFORMS") or os.environ.get("JAX_PLATFORM_NAME")
    if chosen:
        return chosen.split(",")[0].strip().lower() == "cpu"
    accelerator_plugins = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm60_plugin", "jax_rocm7_plugin", "libtpu")
    return not any(importlib.util.find_spec(name) for name in accelerator_plugins)


def maybe_initialize_distributed() -> None:
    """jax.distributed.initialize() when the environment describes a multi-process job: a
    cluster JAX detects by itself (SLURM, Open MPI, ...), or JAX_COORDINATOR_ADDRESS with
    JAX_NUM_PROCESSES and JAX_PROCESS_ID, which JAX itself does not read."""
    env = os.environ
    multi_process = (
        "JAX_COORDINATOR_ADDRESS" in env
        or int(env.get("SLURM_NTASKS", "1")) > 1
        or int(env.get("OMPI_COMM_WORLD_SIZE", "1")) > 1
        or int(env.get("JAX_NUM_PROCESSES", "1")) > 1
    )
    if multi_process:
        import jax

        given = {"num_processes": env.get("JAX_NUM_PROCESSES"), "process_id": env.get("JAX_PROCESS_ID")}
        jax.distributed.initialize(**{k: int(v) for k, v in given.items() if v is not None})
