"""The root conftest.py's guard against running out of memory mappings: a
listener on JAX's backend compiles that clears JAX's caches once the process
holds too many mappings, between the examples of a Hypothesis test too."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fnattn import _jax_private


@pytest.fixture
def root_conftest(pytestconfig):
    # (--import-mode=importlib keeps conftest modules out of sys.modules)
    for plugin in pytestconfig.pluginmanager.get_plugins():
        if hasattr(plugin, "release_programs_past"):
            return plugin
    pytest.fail("the root conftest.py is not loaded")


def test_maps_are_counted(root_conftest):
    if root_conftest._MAP_LIMIT is None:
        pytest.skip("no /proc/sys/vm/max_map_count here")
    assert root_conftest.memory_maps() > 0
    listeners = _jax_private.get("event_duration_listeners")
    assert any(getattr(f, "__qualname__", "").startswith("release_programs_past")
               for f in listeners)


@pytest.mark.parametrize("limit, cleared", [(0, True), (10 ** 9, False)])
def test_caches_cleared_past_the_limit(root_conftest, limit, cleared):
    held = jax.jit(lambda x: x * 3.0)
    held(jnp.ones(3))
    assert held._cache_size() == 1
    listener = root_conftest.release_programs_past(limit, every=2)
    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        f = jax.jit(lambda x: jnp.cos(x) + 1.0)
        outs = [f(jnp.full(n, 0.5)) for n in (5, 6)]  # two compiles: the second checks
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
    for n, out in zip((5, 6), outs):  # (the program compiled as the caches went runs)
        np.testing.assert_allclose(out, np.full(n, np.cos(0.5) + 1.0), rtol=1e-6)
    assert held._cache_size() == (0 if cleared else 1)
