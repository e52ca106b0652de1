"""Adapters that plug fnattn into neural-network libraries.

Each adapter is a module of its own, imported on its own, so that ``import
fnattn`` needs only jax, jaxtyping, beartype and numpy:

- :mod:`fnattn.adapters.flax`: ``attention_fn`` for
  ``flax.nnx.MultiHeadAttention`` and ``flax.linen.MultiHeadDotProductAttention``
  (install with ``pip install 'fnattn[flax]'``).
- :mod:`fnattn.adapters.equinox`: a ``MultiheadAttention`` module over the
  weights of an ``equinox.nn.MultiheadAttention``, and ``attention`` on one
  unbatched sequence of heads (install with ``pip install 'fnattn[equinox]'``).
- :mod:`fnattn.adapters.transformers`: each layer's ``AttentionSpec``, head
  counts and head dims from a Hugging Face ``PretrainedConfig`` (install with
  ``pip install 'fnattn[transformers]'``).

>>> from fnattn.adapters import flax as fnattn_flax
>>> fnattn_flax.attention_fn.__name__
'attention_fn'
"""
