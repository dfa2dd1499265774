"""The UI's time slider (processors/api/ui: ``moment_of``): the moment shown and the span the slider covers."""
import pytest

from processors.api.ui import moment_of
from processors.history.moments import MomentError


NOW = 1_800_000_000_000


@pytest.mark.parametrize("at, span, expected", [
    ("", "1h", {"ms": None, "min_ms": NOW - 3_600_000}),
    (str(NOW - 60_000), "15m", {"ms": NOW - 60_000, "min_ms": NOW - 900_000}),
    ("now-2h", "1h", {"ms": NOW - 7_200_000, "min_ms": NOW - 7_200_000}),  # before the span: the slider reaches it
    ("2027-01-15T06:00:00Z", "7d", {"ms": NOW - 7_200_000, "min_ms": NOW - 7 * 86_400_000}),
])
def test_the_time_slider_s_moment_and_span(at, span, expected):
    got = moment_of(at, span, NOW)
    assert {k: got[k] for k in expected} == expected and got["now_ms"] == NOW and got["span"] == span


@pytest.mark.parametrize("at, span, field", [
    ("yesterday", "1h", "at: "), ("now-", "1h", "at: "), ("t/0@5", "1h", "at: "), ("", "2h", "span: "),
    ("1" * 201, "1h", "at: "),  # longer than any moment: refused before it is parsed
])
def test_a_bad_moment_or_span_is_refused_naming_the_field(at, span, field):
    with pytest.raises(MomentError, match=f"^{field}"):
        moment_of(at, span, NOW)
