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


def tpu_target(device_kind="TPU v5 lite"):
    """Lowering some primitives (e.g. the sign inside integer floor division, as
    in chunked masks) asks for the TPU generation; on CPU an abstract mesh with an
    abstract TPU device answers."""
    try:
        dev = jax.sharding.AbstractDevice(device_kind=device_kind, num_cores=1, platform="tpu")
        mesh = jax.sharding.AbstractMesh((1,), ("x",), abstract_device=dev)
        return jax.sharding.use_abstract_mesh(mesh)
    except (AttributeError, TypeError):  # another JAX version: lower without a target
        return contextlib.nullcontext()
