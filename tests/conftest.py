"""Shared helpers: an independent float64 NumPy attention, forward and backward."""

import os
import sys

import jax
import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))

from np_attention import np_attention, np_attention_grads  # noqa: E402,F401


@pytest.fixture
def rng():
    return np.random.default_rng(0)


def pytest_report_header(config):
    return f"jax {jax.__version__}, devices {jax.devices()}"


_SHARD_MAP = pytest.StashKey()
_SHARD_MAP_TEST = "test_shard_map_on_eight_host_devices"


def pytest_collection_modifyitems(session, config, items):
    # The 8-device checks run in one subprocess (tests/test_shard_map.py). Under
    # pytest-xdist (``-n``) their test goes first, so that the worker it lands on
    # waits for the subprocess while the other workers run the rest of the suite.
    if os.environ.get("PYTEST_XDIST_WORKER"):
        items.sort(key=lambda item: item.name != _SHARD_MAP_TEST)


def pytest_collection_finish(session):
    # In one process, start that subprocess now, beside the rest of the suite (on
    # the machine's other core), when its test is among those collected. (Every
    # xdist worker collects every test: there the test starts it when it runs.)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    for item in session.items:
        if item.name == _SHARD_MAP_TEST:
            session.config.stash[_SHARD_MAP] = item.module.launch()
            break


def pytest_sessionfinish(session):
    # A run that stops before that test (-x, an interrupt) ends the subprocess too.
    proc = session.config.stash.get(_SHARD_MAP, None)
    if proc is not None and proc.poll() is None:
        proc.kill()
        proc.communicate()
