"""The helpers of property_tests/strategies.py that are not strategies."""

from hypothesis import settings

from strategies import examples


def test_examples_bounds_the_ci_profile_and_defers_to_the_others():
    loaded = settings.get_current_profile_name()
    try:
        settings.load_profile("ci")
        assert examples(3).max_examples == 3
        settings.load_profile("dev")  # (200 examples, or HYPOTHESIS_MAX_EXAMPLES)
        assert examples(3).max_examples == settings.get_profile("dev").max_examples != 3
    finally:
        settings.load_profile(loaded)
