"""``fnattn.attention``: the one entry point for dense (training/prefill) attention."""

import jax
from beartype import beartype
from jaxtyping import Array, Shaped, jaxtyped

from fnattn import _checks, _dispatch, cudnn, position_bias, xla
from fnattn.reference import prepare, reference
from fnattn.spec import AttentionOutput, AttentionSpec

__all__ = ["attention", "lowering_table"]


def lowering_table(impl: str, dtype=None):
    """The (platform, lowering) table that ``impl`` selects for inputs of ``dtype``."""
    if impl == "xla":
        return (("default", xla.DENSE),)
    if impl in ("auto", "pallas"):
        from fnattn.flash import api as flash_api
        return flash_api.lowering_table(impl, dtype)
    raise ValueError(f"no lowering table for impl={impl!r}")


def run(spec: AttentionSpec, q, k, v, *, fn: str, table=None) -> AttentionOutput:
    """Validates, dispatches through the custom_jvp, and restores the layout."""
    dims, qb, kb, vb, scale, seed = prepare(spec, q, k, v, fn)
    if spec.impl == "cudnn":
        _checks.refuse_position_bias(spec, f"{fn} with impl='cudnn'")
        res = cudnn.attention(spec, dims, qb, kb, vb, scale=scale)
        out = _checks.from_bthd(res.out, spec.layout)
        return AttentionOutput(out, res.lse if spec.return_lse else None)
    # A position term rides with the mask's arrays to every lowering's tiles.
    mask = position_bias.attach(spec.mask, spec.position_bias, constant=False)
    leaves, treedef = jax.tree_util.tree_flatten(mask)
    cfg = _dispatch.Config(dims=dims, scale=scale, softcap=spec.softcap,
                           dropout_rate=float(spec.dropout_rate), mask_treedef=treedef,
                           block_sizes=spec.block_sizes)
    table = lowering_table(spec.impl, qb.dtype) if table is None else table
    out, lse = _dispatch.attend(table, cfg, qb, kb, vb, spec.bias, spec.sinks,
                                tuple(leaves), seed)
    return AttentionOutput(_checks.from_bthd(out, spec.layout),
                           lse if spec.return_lse else None)


# q, k, v are annotated "...": rank and shape errors come from _checks.check_qkv,
# which names the axes expected for the layout.
@_checks.entry_point("fnattn.attention")
@jaxtyped(typechecker=beartype)
def attention(spec: AttentionSpec, q: Shaped[Array, "..."], k: Shaped[Array, "..."],
              v: Shaped[Array, "..."]) -> AttentionOutput:
    """Attention of ``q`` over ``k``/``v`` as described by ``spec``.

    ``spec.impl`` picks the lowering: "auto" (flash, chosen at trace time: on
    NVIDIA GPUs cuDNN where it computes the spec exactly, else the Pallas Mosaic
    GPU kernels on Hopper or the Pallas Triton kernels; the Pallas Mosaic
    kernels on TPU; XLA elsewhere; docs/flash.md has the routing table),
    "pallas" (the Pallas kernels; interpreted on CPU), "xla" (dense XLA),
    "cudnn" (``jax.nn.dot_product_attention``) or "reference".

    Args:
      spec: the :class:`AttentionSpec`.
      q: (B, Tq, Hq, D) in "bthd" or (B, Hq, Tq, D) in "bhtd".
      k: (B, Tk, Hkv, D) or (B, Hkv, Tk, D); Hq must be a multiple of Hkv.
      v: (B, Tk, Hkv, Dv) or (B, Hkv, Tk, Dv).

    Returns:
      :class:`AttentionOutput` with ``out`` in q's dtype and layout and
      ``lse`` (B, Hq, Tq) float32 (None if ``spec.return_lse`` is False).

    >>> import jax, jax.numpy as jnp
    >>> import fnattn
    >>> from fnattn import AttentionSpec, masks
    >>> q = jax.random.normal(jax.random.key(0), (2, 16, 4, 8))
    >>> k = v = jax.random.normal(jax.random.key(1), (2, 16, 2, 8))
    >>> spec = AttentionSpec(mask=masks.causal(), softcap=30.0)
    >>> res = jax.jit(fnattn.attention)(spec, q, k, v)
    >>> res.out.shape, res.lse.shape
    ((2, 16, 4, 8), (2, 4, 16))
    >>> g = jax.jit(jax.grad(lambda q: fnattn.attention(spec, q, k, v).out.sum()))(q)
    >>> g.shape
    (2, 16, 4, 8)
    """
    if spec.impl == "reference":
        return reference(spec, q, k, v)
    return run(spec, q, k, v, fn="attention")
