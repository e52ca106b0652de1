"""Latent caches (multi-head latent attention): values that are the first
``value_dim`` channels of the keys' own storage.

With the up-projections absorbed into the query, an MLA layer is MQA whose keys
are a latent of Dc channels plus Dr rope channels per token and whose values
are the first Dc of them. The serving variants take such a cache as the keys
with no values (``v_cache=None`` / ``v_pages=None``) and ``value_dim=Dc``: no
second pool, no copy; the lowerings take the values from the keys they load.
"""

import jax
import jax.numpy as jnp

from fnattn import quant


def values(fn: str, k, v, value_dim, q, *, k_name: str, v_name: str):
    """The values' stand-in for the checks of float caches: ``v`` itself, or for a
    latent cache (``value_dim`` given, ``v`` None) a shape/dtype of the keys' first
    ``value_dim`` channels. Raises for a latent cache given with separate values,
    a ``value_dim`` outside ``[1, D]``, or no values at all."""
    if value_dim is None:
        if v is None:
            raise ValueError(f"{fn}: {v_name} is None: pass the values, or value_dim=Dc for a "
                             f"latent cache whose values are the first Dc channels of {k_name}")
        return v
    if v is not None:
        raise ValueError(f"{fn}: a latent cache (value_dim={value_dim!r}) has no separate "
                         f"{v_name}: its values are the first value_dim channels of {k_name}. "
                         f"Pass {v_name}=None, or drop value_dim for separate values.")
    D = k.shape[-1]
    if not isinstance(value_dim, int) or isinstance(value_dim, bool) or not 0 < value_dim <= D:
        raise ValueError(f"{fn}: value_dim must be an int in [1, D={D}] (the values are the "
                         f"first value_dim of {k_name}'s {D} channels, {k_name} "
                         f"{tuple(k.shape)}); got {value_dim!r}")
    dtype = getattr(q, "dtype", jnp.float32) if quant.is_quantized(k) else k.dtype
    return jax.ShapeDtypeStruct(tuple(k.shape[:-1]) + (value_dim,), dtype)


def take_values(k, v, value_dim):
    """``v``, or (latent) the first ``value_dim`` channels of the loaded keys ``k``."""
    return k[..., :value_dim] if v is None else v
