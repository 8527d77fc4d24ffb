"""The suite's hypothesis profiles, and the example budget of the tests that draw hundreds.

``fast`` is the default (no shrinking: a failing example is printed as found, with the blob that
replays it, in seconds rather than the minutes shrinking takes); ``shrink`` shrinks a failure found;
``ci`` (chosen where ``CI`` is set) is ``fast`` with no example database, so each run does the same
work; ``thorough`` shrinks too and gives each test its full count (:func:`examples`). A profile is
chosen with ``--hypothesis-profile NAME`` or ``HYPOTHESIS_PROFILE=NAME``. None has a deadline: a
timed assertion on a shared machine fails at random; the time is bounded by each test's
``max_examples`` (50 where a test sets none).

A property test whose power is its count (a rule's corner that shows in a few examples of hundreds:
the fold properties' shared weights, Identity chains and float16 overflows) asks for
``max_examples=examples(N)``: ``N`` under ``thorough``, a third of it under the others, so the
suite a developer runs (``make test``) draws fewer and ``make test-thorough`` draws them all. The
tests that ask are derandomized: each profile draws the same examples on every run.
"""

from __future__ import annotations

import math
import os

from hypothesis import Phase, settings

THOROUGH = "thorough"
SHARE = 3  # the other profiles draw a third of a thorough run's examples


def register() -> None:
    """Register the profiles and load the one the environment names (``--hypothesis-profile``, read
    by hypothesis's pytest plugin after this, overrides it)."""
    settings.register_profile("shrink", deadline=None, max_examples=50, print_blob=True)
    settings.register_profile("fast", settings.get_profile("shrink"),
                              phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.target])
    settings.register_profile("ci", settings.get_profile("fast"), database=None)
    settings.register_profile(THOROUGH, settings.get_profile("shrink"))
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE") or ("ci" if os.environ.get("CI") else "fast"))


def examples(full: int) -> int:
    """``max_examples`` for a test whose thorough run draws ``full``: all of them under the
    ``thorough`` profile, a :data:`SHARE` of them (rounded up) under the others. Read when the test
    module is imported, after the profile is loaded."""
    if _current_profile() == THOROUGH:
        return full
    return math.ceil(full / SHARE)


def _current_profile() -> str:
    """The loaded profile's name (``settings.get_current_profile_name()``, which hypothesis releases
    before it lack: they keep the name in ``settings._current_profile``; pyproject allows them)."""
    getter = getattr(settings, "get_current_profile_name", None)
    return getter() if getter is not None else settings._current_profile
