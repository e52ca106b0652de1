"""fnattn inside equinox models.

Equinox computes attention inside ``equinox.nn.MultiheadAttention.__call__``
and offers no hook to replace it (``process_heads`` only transforms the
heads), so the adapter is a module around an ``eqx.nn.MultiheadAttention``:
:class:`MultiheadAttention` keeps its projections, dropout and call signature
(one unbatched sequence; ``jax.vmap`` over a batch, as in equinox) and computes
the attention with fnattn from an :class:`~fnattn.AttentionSpec`. For a module
of your own, :func:`attention` takes one unbatched sequence of heads.

Differences from equinox: a query row that sees no key gives zeros (equinox's
softmax gives the mean of the values); dropout draws fnattn's keep mask (a
hash of the positions, see :mod:`fnattn.dropout`) from the call's ``key``
rather than ``jax.random.bernoulli``'s, with the same rate and rescaling.

>>> import jax, jax.numpy as jnp, equinox as eqx
>>> from fnattn import AttentionSpec, masks
>>> from fnattn.adapters.equinox import MultiheadAttention
>>> mha = eqx.nn.MultiheadAttention(num_heads=2, query_size=8, key=jax.random.key(0))
>>> attn = MultiheadAttention(mha, AttentionSpec(mask=masks.causal()))
>>> x = jnp.ones((3, 5, 8))                            # 3 sequences of 5 tokens
>>> eqx.filter_jit(jax.vmap(lambda x: attn(x, x, x)))(x).shape
(3, 5, 8)
"""

import numbers
from typing import Callable, Optional

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Bool, Float, PRNGKeyArray

try:
    import equinox as eqx
except ImportError as e:  # pragma: no cover - the extra is installed in CI
    raise ImportError("fnattn.adapters.equinox needs equinox: install it with "
                      "pip install 'fnattn[equinox]'") from e

from fnattn import masks
from fnattn.core import attention as _attention
from fnattn.spec import AttentionSpec

__all__ = ["MultiheadAttention", "attention"]


def _shape(x) -> tuple:
    return tuple(np.shape(x))


def _check_spec(fn: str, spec) -> AttentionSpec:
    if not isinstance(spec, AttentionSpec):
        raise TypeError(f"{fn}: spec must be an fnattn.AttentionSpec; got "
                        f"{type(spec).__name__}. The spec comes first: "
                        f"{fn}(spec, query_heads, key_heads, value_heads).")
    if spec.layout != "bthd":
        raise ValueError(f"{fn}: spec.layout must be 'bthd': the heads are (seq_length, "
                         f"num_heads, head_dim); got {spec.layout!r}. Leave the layout at "
                         "its default.")
    return spec


def attention(spec: AttentionSpec,
              query_heads: Float[Array, "q_seq num_heads qk_size"],
              key_heads: Float[Array, "kv_seq num_kv_heads qk_size"],
              value_heads: Float[Array, "kv_seq num_kv_heads vo_size"],
              mask: Optional[Bool[Array, "..."]] = None,
              ) -> Float[Array, "q_seq num_heads vo_size"]:
    """Attention of one unbatched sequence of heads, as ``spec`` describes.

    The heads are those ``eqx.nn.MultiheadAttention`` forms (and passes to
    ``process_heads``); batch with ``jax.vmap``. Dropout, if any, is the spec's
    (``dropout_rate``, ``dropout_key``).

    Args:
      spec: the :class:`~fnattn.AttentionSpec` (layout "bthd").
      query_heads: (q_seq, num_heads, qk_size).
      key_heads: (kv_seq, num_kv_heads, qk_size); ``num_heads`` a multiple of
        ``num_kv_heads``.
      value_heads: (kv_seq, num_kv_heads, vo_size).
      mask: boolean (q_seq, kv_seq), or (num_heads, q_seq, kv_seq) for one mask
        per head; True attends. Combined with the spec's mask by ``&``.

    Returns:
      (q_seq, num_heads, vo_size), in the heads' dtype.

    >>> import jax, jax.numpy as jnp
    >>> from fnattn import AttentionSpec
    >>> from fnattn.adapters.equinox import attention
    >>> q = k = v = jax.random.normal(jax.random.key(0), (5, 2, 4))
    >>> attention(AttentionSpec(), q, k, v, mask=jnp.tri(5, dtype=bool)).shape
    (5, 2, 4)
    """
    fn = "fnattn.adapters.equinox.attention"
    spec = _check_spec(fn, spec)
    for name, x in (("query_heads", query_heads), ("key_heads", key_heads),
                    ("value_heads", value_heads)):
        if jnp.ndim(x) != 3:
            raise ValueError(f"{fn}: {name} must have 3 axes (seq_length, num_heads, "
                             f"head_dim), one unbatched sequence (jax.vmap over a batch); "
                             f"got shape {_shape(x)}")
    T, H = query_heads.shape[:2]
    S = key_heads.shape[0]
    if mask is not None:
        if jnp.result_type(mask) != jnp.bool_:
            raise TypeError(f"{fn}: mask must be boolean (True attends); got "
                            f"{jnp.result_type(mask)} with shape {_shape(mask)}. Convert "
                            "a mask of 1s and 0s with `mask > 0`; an additive mask is a "
                            "bias: AttentionSpec(bias=...).")
        if _shape(mask) not in ((T, S), (H, T, S)):
            raise ValueError(f"{fn}: mask must have shape (q_seq, kv_seq)=({T}, {S}) or "
                             f"(num_heads, q_seq, kv_seq)=({H}, {T}, {S}); got "
                             f"{_shape(mask)}")
        given = masks.from_array(jnp.reshape(mask, (1, -1, T, S)))
        spec = spec.replace(mask=given if spec.mask is None else spec.mask & given)
    res = _attention(spec.replace(return_lse=False), query_heads[None], key_heads[None],
                     value_heads[None])
    return res.out[0]


class MultiheadAttention(eqx.Module):
    """``eqx.nn.MultiheadAttention``'s layer with fnattn computing the attention.

    Wraps an ``eqx.nn.MultiheadAttention`` (its projections and ``dropout``,
    which ``eqx.nn.inference_mode`` toggles as usual) and adds an
    :class:`~fnattn.AttentionSpec`: a mask, soft-cap, scale, lowering, or
    ``sinks`` (a field of this module, so ``eqx.filter_grad`` trains them).

    Args:
      mha: the ``eqx.nn.MultiheadAttention`` whose weights to use.
      spec: what attention to compute (layout "bthd", no dropout fields: the
        rate is ``mha.dropout.p``). None: ``AttentionSpec()``.

    >>> import jax, jax.numpy as jnp, equinox as eqx
    >>> from fnattn import AttentionSpec
    >>> from fnattn.adapters.equinox import MultiheadAttention
    >>> mha = eqx.nn.MultiheadAttention(2, 8, dropout_p=0.1, key=jax.random.key(0))
    >>> attn = MultiheadAttention(mha, AttentionSpec(softcap=20.0))
    >>> x = jnp.ones((5, 8))
    >>> attn(x, x, x, key=jax.random.key(1)).shape     # dropout on: a key is needed
    (5, 8)
    """

    mha: eqx.nn.MultiheadAttention
    spec: AttentionSpec

    def __init__(self, mha: eqx.nn.MultiheadAttention, spec: Optional[AttentionSpec] = None):
        if not isinstance(mha, eqx.nn.MultiheadAttention):
            raise TypeError(f"MultiheadAttention: mha must be an eqx.nn.MultiheadAttention; "
                            f"got {type(mha).__name__}")
        spec = _check_spec("MultiheadAttention", AttentionSpec() if spec is None else spec)
        if spec.dropout_rate or spec.dropout_key is not None:
            raise ValueError("MultiheadAttention: the spec's dropout fields must be unset "
                             f"(got dropout_rate={spec.dropout_rate!r}): the rate is "
                             "mha.dropout.p and the key the call's key=.")
        self.mha = mha
        self.spec = spec

    def __call__(self, query: Float[Array, "q_seq q_size"], key_: Float[Array, "kv_seq k_size"],
                 value: Float[Array, "kv_seq v_size"], mask: Optional[Bool[Array, "..."]] = None,
                 *, key: Optional[PRNGKeyArray] = None, inference: Optional[bool] = None,
                 process_heads: Optional[Callable] = None) -> Float[Array, "q_seq o_size"]:
        """As ``eqx.nn.MultiheadAttention.__call__``.

        Args:
          query: (q_seq, query_size).
          key_: (kv_seq, key_size).
          value: (kv_seq, value_size).
          mask: boolean (q_seq, kv_seq) or (num_heads, q_seq, kv_seq); True
            attends.
          key: the dropout key, needed when dropout is on.
          inference: no dropout (None: ``mha.dropout.inference``).
          process_heads: a function of the (query, key, value) heads returning
            heads of the same shapes (rotary embeddings, say).

        Returns:
          (q_seq, output_size).
        """
        mha = self.mha
        if key_.shape[0] != value.shape[0]:
            raise ValueError(f"MultiheadAttention: key_ and value must have the same length; "
                             f"got key_ {_shape(key_)} and value {_shape(value)}")

        def project(proj, x):
            return jax.vmap(proj)(x).reshape(x.shape[0], mha.num_heads, -1)

        heads = (project(mha.query_proj, query), project(mha.key_proj, key_),
                 project(mha.value_proj, value))
        if process_heads is not None:
            shapes = tuple(h.shape for h in heads)
            heads = tuple(process_heads(*heads))
            if tuple(h.shape for h in heads) != shapes:
                raise ValueError(f"MultiheadAttention: process_heads must not change the "
                                 f"shapes of the heads {shapes}; got "
                                 f"{tuple(h.shape for h in heads)}")
        spec = self.spec
        p = mha.dropout.p
        if inference is None:
            inference = mha.dropout.inference
        if isinstance(p, jax.core.Tracer) or not isinstance(p, numbers.Real):
            raise TypeError("MultiheadAttention: mha.dropout.p must be a Python float: fnattn "
                            f"needs the rate when tracing; got {type(p).__name__}. Use "
                            "eqx.filter_jit, which keeps Python floats static.")
        if float(p) > 0 and not inference:
            if key is None:
                raise ValueError("MultiheadAttention: dropout is on (mha.dropout.p="
                                 f"{float(p)}, inference=False) and needs key=; got None. "
                                 "Pass key=..., or inference=True.")
            spec = spec.replace(dropout_rate=float(p), dropout_key=key)
        out = attention(spec, *heads, mask=mask)
        return jax.vmap(mha.output_proj)(out.reshape(out.shape[0], -1))
