"""The helpers of property_tests/strategies.py that are not strategies."""

from hypothesis import settings

from strategies import examples


def test_examples_bounds_the_ci_profile_and_defers_to_the_others(monkeypatch):
    monkeypatch.setenv("HYPOTHESIS_PROFILE", "ci")
    assert examples(3).max_examples == 3
    monkeypatch.setenv("HYPOTHESIS_PROFILE", "dev")
    # (the loaded profile's count: under "dev" its 200, or HYPOTHESIS_MAX_EXAMPLES)
    assert examples(3).max_examples == settings.default.max_examples
    monkeypatch.delenv("HYPOTHESIS_PROFILE")
    assert examples(5).max_examples == 5
