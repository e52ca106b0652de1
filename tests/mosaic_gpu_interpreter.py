"""Running the Pallas Mosaic GPU kernels in JAX's Mosaic GPU interpreter on CPU.

The interpreter runs each warpgroup of each program as its own XLA computation
on its own thread (``thread_map``), and compiles that computation afresh every
time: once per warpgroup per program of the grid. :func:`compile_once` memoises
the compilation per (program, argument types): the same program gives the same
executable, so the kernels run as before, three to four times sooner.

The warpgroups of a program wait for one another at barriers, inside host
callbacks of the kernel's outer computation, so they need more XLA:CPU threads
than a two-core machine has by default: the root ``conftest.py`` sets
``PJRT_NPROC`` (without it, runs hang at random there).

:func:`triton_kernels` and ``REDO_KERNELS`` are what the Mosaic GPU test files
read off programs lowered for cuda.
"""

import contextlib
import functools
import re
import threading

import jax
import jax.numpy as jnp

from fnattn import _jax_private
from fnattn._dispatch import Lowering
from fnattn.flash import mosaic_gpu, mosaic_gpu_bwd


@contextlib.contextmanager
def compile_once():
    """Within the context, the interpreter compiles each warpgroup program once.

    A no-op on a JAX whose interpreter is laid out differently.
    """
    try:
        thread_map = _jax_private.get("interpret_thread_map")
    except ImportError:
        yield
        return
    if not hasattr(thread_map, "_run_jaxpr"):
        yield
        return
    compiled, lock = {}, threading.Lock()

    def run(jaxpr, consts, *args):
        key = (id(jaxpr),) + tuple((jnp.shape(x), jnp.result_type(x)) for x in (*consts, *args))
        with lock:
            hit = compiled.get(key)
            if hit is None:
                def body(consts, *args):
                    jax.core.eval_jaxpr(jaxpr, consts, *args)
                # (the jaxpr stays alive beside its executable: its id stays unique)
                hit = compiled[key] = (jaxpr, jax.jit(body).trace(consts, *args).lower()
                                       .compile())
        hit[1](consts, *args)

    original = thread_map._run_jaxpr
    thread_map._run_jaxpr = run
    try:
        yield
    finally:
        thread_map._run_jaxpr = original


def flash_table(name):
    """A lowering table (``core.run``'s ``table``) holding one lowering, named
    ``name``: the Mosaic GPU forward and backward, run by the interpreter."""
    ip = mosaic_gpu.interpret_params()
    return (("default", Lowering(name, functools.partial(mosaic_gpu.forward, interpret=ip),
                                 functools.partial(mosaic_gpu_bwd.backward, interpret=ip))),)


def reset_after_failure():
    """Clears the interpreter's global state after a kernel failed (else the next
    interpreted kernel of the process reports the same failure)."""
    _jax_private.get("gpu_interpret_pallas_call").reset_gpu_interpret_mode_state()


# (a masked Mosaic GPU forward at a power-of-two head dim: the Triton forward that
# recomputes the rows it flags, hidden_keys="auto")
REDO_KERNELS = ["fnattn_flash_fwd_redo"]


def triton_kernels(text):
    """The names of fnattn's flash Triton kernels in a lowered program's text, sorted.
    (From jax 0.11 the serialized Mosaic GPU kernels carry their names too:
    ``fnattn_flash_mosaic_gpu_bwd...``, left out.)"""
    return sorted({n for n in re.findall(r"fnattn_flash_\w+", text) if "mosaic_gpu" not in n})
