"""Checks that need several devices, run by ``tests/test_shard_map.py`` in one
subprocess on 8 virtual CPU devices (each module ``*_checks.py`` exposes
``CHECKS``, a list of no-argument functions)."""
