"""The memory budget: what one device can hold, and a config refused before anything is
allocated or compiled where the planner's estimate of what it needs is more."""

from __future__ import annotations

import os

from shardflow.train.run_setup import Run


def device_memory() -> tuple[int | None, str]:
    """(bytes one device can hold, what that is), or (None, why unknown)."""
    import jax

    device = jax.local_devices()[0]
    try:
        limit = (device.memory_stats() or {}).get("bytes_limit")
    except Exception:  # a backend without memory statistics
        limit = None
    if limit:
        return limit, f"the {gib(limit)} of each {device.device_kind}"
    if device.platform == "cpu":
        host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        n = jax.local_device_count()
        return host // n, (f"{gib(host // n)} each of {n} CPU devices ({gib(host)} of host memory shared)")
    return None, f"{device.device_kind} reports no memory size"


def gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:,.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:,.1f} MiB"


def params_text(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def check_memory(run: Run, plan) -> None:
    """A ConfigError if the planner's estimate of what one device holds during the step exceeds
    what a device has: before anything is allocated or compiled. The estimate is a lower bound
    (the planner counts the step's inputs and what its loops hold for the backward, not the
    other intermediates), so what it refuses cannot fit."""
    from shardflow.train.config import ConfigError

    available, what = device_memory()
    if available is None or plan.memory_bytes <= available:
        return
    cfg = run.cfg
    remedies = ["more devices"]
    if cfg.strategy not in ("fsdp", "2d") and not isinstance(cfg.strategy, dict):
        remedies.append("strategy fsdp or 2d (the parameters and optimizer state split)")
    if run.model_cfg.remat != "full":
        remedies.append("model.remat=full")
    remedies.append("a smaller batch_size (or a larger grad_accum) or data.seq_len")
    where = " (this machine has CPU devices only)" if run.mesh.devices.flat[0].platform == "cpu" else ""
    raise ConfigError(
        f"model {cfg.model} ({params_text(run.n_params)} parameters) needs an estimated "
        f"{gib(plan.memory_bytes)} per device on mesh {dict(run.mesh.shape)} (the {cfg.planner} "
        f"planner's estimate, a lower bound: {gib(plan.input_bytes)} of parameters, optimizer "
        f"state and batch + {gib(plan.loop_bytes)} of activations the layers keep for the "
        f"backward), more than {what}. Run it on accelerators with at least "
        f"{gib(plan.memory_bytes)} each{where}, or make the step need less per device: " + ", ".join(remedies)
    )
