"""Test setup: 8 simulated CPU devices, set before JAX is imported anywhere."""

import os

import pytest

# Every pass checks the facts it ensures (shardflow.passes) in the tests and CI.
os.environ.setdefault("SHARDFLOW_CHECK", "1")
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()

CPU_COMPILE_FLAGS = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"


def pytest_configure(config):
    # JAX reads JAX_PLATFORMS when it is imported, so this runs before anything imports it: the
    # suite runs on the simulated CPU devices, except a `-m gpu` run, which needs the GPU.
    if "gpu" not in (config.option.markexpr or ""):
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
        # XLA:CPU compiling is most of the suite's time. Its legacy elemental emitters at LLVM's -O0
        # compile a train step about 3x faster than the default fusion emitters at -O2, and what the
        # tests compare (a program against itself on one device) is compiled the same way on both sides.
        if CPU_COMPILE_FLAGS not in os.environ["XLA_FLAGS"]:
            os.environ["XLA_FLAGS"] += " " + CPU_COMPILE_FLAGS
    if "not slow" in (config.option.markexpr or ""):
        # The fast tier: each hypothesis test on a tenth of its examples (fast_tier.examples),
        # tests that name no count on ten; read when the test modules are imported, after this.
        os.environ["SHARDFLOW_FAST_TIER"] = "1"
        from hypothesis import settings

        settings.register_profile("fast", max_examples=10)
        settings.load_profile("fast")
    import jax

    jax.config.update("jax_enable_x64", False)


def pytest_collection_modifyitems(config, items):
    # A sweep (every row of a comparison table: tens of minutes on 2 cores) runs where -m names it.
    if "sweep" in (config.option.markexpr or ""):
        return
    swept = [item for item in items if item.get_closest_marker("sweep")]
    if swept:
        config.hook.pytest_deselected(items=swept)
        items[:] = [item for item in items if not item.get_closest_marker("sweep")]


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory):
    """A small token corpus prepared from the standard library's sources, shared by the trainer tests."""
    from shardflow.train import data

    return data.prepare(data.stdlib_sources(max_bytes=300_000)[:10], tmp_path_factory.mktemp("tokens"))
