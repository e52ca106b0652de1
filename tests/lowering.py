"""Helpers shared by the kernel tests: cheap compiles for interpret mode, and a
TPU target for lowering Mosaic kernels on a CPU."""

import contextlib

import jax


@contextlib.contextmanager
def cheap_compiles():
    """Interpret mode turns each kernel into a large XLA program whose compilation,
    not its run, is most of a kernel test's time: skip most XLA optimisations while
    the block runs (a JAX without the flag compiles as usual). Restored afterwards."""
    try:
        old = jax.config.read("jax_disable_most_optimizations")
    except (AttributeError, KeyError):
        yield
        return
    jax.config.update("jax_disable_most_optimizations", True)
    try:
        yield
    finally:
        jax.config.update("jax_disable_most_optimizations", old)


# What each kind of device is called when lowering for it with no such device.
TARGETS = {"tpu": ("TPU v5 lite", 1), "cuda": ("NVIDIA H100 80GB HBM3", 132)}


def abstract_mesh(platform, shape=(1,), names=("x",)):
    """An abstract mesh of ``platform`` ("tpu" or "cuda") devices, or None on a
    JAX without abstract devices."""
    kind, cores = TARGETS[platform]
    try:
        dev = jax.sharding.AbstractDevice(device_kind=kind, num_cores=cores,
                                          platform="gpu" if platform == "cuda" else platform)
        # Auto axes, the default before jax 0.11 (Explicit since)
        auto = (jax.sharding.AxisType.Auto,) * len(names)
        return jax.sharding.AbstractMesh(shape, names, axis_types=auto, abstract_device=dev)
    except (AttributeError, TypeError):
        return None


def target(platform, mesh=None):
    """A context in which code traced and lowered for ``platform`` finds a device
    of that kind: some primitives ask for the TPU generation (e.g. the sign
    inside integer floor division, as in chunked masks), and the Triton
    lowering asks for the GPU's compute capability (JAX 0.11 and later). On a
    CPU an abstract mesh with an abstract device answers. Code and ``.lower``
    both go inside."""
    mesh = abstract_mesh(platform) if mesh is None else mesh
    if mesh is None:  # another JAX version: lower without a target
        return contextlib.nullcontext()
    return jax.sharding.use_abstract_mesh(mesh)


def tpu_target():
    return target("tpu")


def gpu_target():
    return target("cuda")


def mosaic_gpu_smem(lower):
    """The shared memory Mosaic GPU counts for the first kernel that ``lower()``
    (a function lowering a program for cuda) compiles: lowered under a limit of
    one byte, the kernel is refused with its count in the message. Skips the
    test on a JAX without that limit."""
    import re

    import pytest
    try:
        from jax.experimental.mosaic.gpu.core import artificial_shared_memory_limit
    except ImportError:
        pytest.skip("this JAX has no artificial_shared_memory_limit")
    with artificial_shared_memory_limit(1), pytest.raises(ValueError) as err:
        lower()
    found = re.search(r"smem_bytes=(\d+)", str(err.value))
    assert found, f"no shared memory count in {err.value}"
    return int(found.group(1))
