"""Every JAX internal fnattn (and its tests) reaches, in one place.

``jax._src`` is JAX's private package: a release may move or rename anything in
it. fnattn uses a public API wherever one does the job, and goes through this
module for the rest, so that a release that moves a symbol fails here, by
name, with the JAX version (``tests/test_jax_private.py`` resolves every entry
of :data:`USES`), instead of somewhere inside a kernel's lowering.

Each entry says what the symbol is for and which public API was checked for it
(``jax.extend``, ``jax.ffi``, ``jax.export``, ``jax.monitoring``, ``jax.core``,
``jax.experimental.pallas``...). Importing this module imports no ``jax._src``
module beyond those ``import jax`` already loads, and starts no backend.

>>> sorted(USES)[:3]
['backend_compile_event', 'backends_started', 'cudnn_fused_attention']
"""

import dataclasses
import importlib
import re

import jax

__all__ = ["JaxInternalMoved", "TESTED_JAX", "USES", "check_version", "get"]

# The jax releases the test suite runs under (.ci/run: the oldest and the newest;
# .ci/lowering-jax-0.11: the lowerings under 0.11). pyproject.toml says the same.
TESTED_JAX = ("0.10.2", "0.11.2", "0.12.0.1")


def _minor(version: str) -> tuple:
    """(major, minor) of a version string such as "0.13.0.dev20260101"."""
    m = re.match(r"(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def check_version(version: str | None = None) -> str | None:
    """Warns (once, a ``UserWarning``) when ``version`` (default: the installed
    jax's) is a release newer than the newest fnattn was tested with, naming the
    tested range; returns the warning's text, or None. Older releases than the
    oldest tested are pip's to refuse (pyproject.toml's ``jax>=0.10.2``).

    >>> check_version("0.12.0.1") is None
    True
    """
    version = jax.__version__ if version is None else version
    if _minor(version) <= _minor(TESTED_JAX[-1]):
        return None
    text = (f"fnattn was tested with jax {TESTED_JAX[0]} to {TESTED_JAX[-1]} "
            f"({', '.join(TESTED_JAX)}); jax {version} is newer: fnattn may fail where it "
            "uses JAX internals (fnattn/_jax_private.py names them)")
    import warnings
    warnings.warn(text, UserWarning, stacklevel=3)
    return text


class JaxInternalMoved(ImportError):
    """A ``jax._src`` symbol fnattn uses is not where this JAX release keeps it."""


@dataclasses.dataclass(frozen=True)
class Use:
    """One private symbol: ``module`` (under ``jax._src``), ``attr`` (None: the
    module itself), what fnattn uses it for, and the public API checked."""

    module: str
    attr: str | None
    used_for: str
    public_checked: str
    public: tuple = ()   # (module, attr) of a public equivalent, tried first


USES = {
    "no_axis_name": Use(
        "core", "no_axis_name",
        "fnattn._platforms.axis_name_of: tells an unnamed jax.vmap level from a named one "
        "in a batching rule (batching.fancy_primitive_batchers)",
        "jax.core.no_axis_name (deprecated in 0.10, gone in 0.12); jax.extend.core has no "
        "counterpart"),
    "prim_requires_devices_during_lowering": Use(
        "dispatch", "prim_requires_devices_during_lowering",
        "fnattn._platforms: jit keeps the devices when lowering a program holding "
        "fnattn's platform primitive (cuDNN's custom_partitioning lowering needs them)",
        "jax.extend.core / jax.extend.lowering / jax.extend.mlir: no counterpart"),
    "cudnn_fused_attention": Use(
        "cudnn.fused_attention_stablehlo", None,
        "fnattn.flash.cudnn: cuDNN's fused forward with its softmax statistics (lse) and "
        "its backward run from those residuals",
        "jax.nn.dot_product_attention(implementation='cudnn') returns no lse and takes "
        "no residuals; jax.ffi would need cuDNN's frontend built here"),
    "mosaic_gpu_interpret_params": Use(
        "pallas.mosaic_gpu.interpret.params", "InterpretGPUParams",
        "fnattn.flash.mosaic_gpu.interpret_params: runs the Mosaic GPU kernels in the "
        "interpreter on a CPU",
        "jax.experimental.pallas.mosaic_gpu.InterpretGPUParams (public from jax 0.12; "
        "absent in 0.10)",
        public=(("jax.experimental.pallas.mosaic_gpu", "InterpretGPUParams"),)),
    "backend_compile_event": Use(
        "dispatch", "BACKEND_COMPILE_EVENT",
        "conftest.py: the jax.monitoring event of a backend compile (the memory-mapping "
        "guard counts them)",
        "jax.monitoring names no events"),
    "event_duration_listeners": Use(
        "monitoring", "_event_duration_secs_listeners",
        "tests/test_conftest.py: that conftest.py's listener is registered",
        "jax.monitoring registers and unregisters listeners but does not list them"),
    "backends_started": Use(
        "xla_bridge", "backends_are_initialized",
        "tests/test_spec.py: that importing fnattn starts no JAX backend",
        "jax.extend.backend.backends() starts them; no public query"),
    "interpret_thread_map": Use(
        "pallas.mosaic.interpret.thread_map", None,
        "tests/mosaic_gpu_interpreter.py: compiles each interpreted warpgroup program once "
        "(its _run_jaxpr), a test-speed measure only",
        "jax.experimental.pallas: no counterpart"),
    "gpu_interpret_pallas_call": Use(
        "pallas.mosaic_gpu.interpret.interpret_pallas_call", None,
        "tests/mosaic_gpu_interpreter.py: reset_gpu_interpret_mode_state clears the "
        "interpreter's state after a kernel failed",
        "jax.experimental.pallas.mosaic_gpu has set/force_gpu_interpret_mode (0.12), no reset"),
}

_MISSING = object()
_found = {}  # name -> what get() found (a module, a class, a set...)


def _moved(name: str, use: Use, error: Exception) -> JaxInternalMoved:
    where = f"jax._src.{use.module}" + (f".{use.attr}" if use.attr else "")
    return JaxInternalMoved(
        f"jax {jax.__version__} has no {where} ({error}); fnattn uses it for "
        f"{use.used_for}. Public API checked: {use.public_checked}. Use a jax version "
        f"fnattn was tested with (fnattn._jax_private.TESTED_JAX) or update fnattn/_jax_private.py "
        f"({name!r}).")


def get(name: str, default=_MISSING):
    """The symbol :data:`USES` names ``name``: its public equivalent where this
    JAX has one, else the private one. Raises :class:`JaxInternalMoved` (naming
    the JAX version and the symbol) where it is gone, or returns ``default``
    when one is given.

    >>> get("backend_compile_event")
    '/jax/core/compile/backend_compile_duration'
    """
    if name in _found:
        return _found[name]
    use = USES[name]
    for module, attr in use.public:
        try:
            found = _found[name] = getattr(importlib.import_module(module), attr)
            return found
        except (ImportError, AttributeError):
            pass
    try:
        mod = importlib.import_module(f"jax._src.{use.module}")
        found = _found[name] = mod if use.attr is None else getattr(mod, use.attr)
        return found
    except (ImportError, AttributeError) as e:
        if default is not _MISSING:
            return default
        raise _moved(name, use, e) from e
