"""Environment settings that name a set of parts (TRELLIS_CHAIN's links, TRELLIS_OPEN_SUMS's
readers): one parser, so that both read 0 / 1 / a comma list the same way."""
from __future__ import annotations

import warnings


def parse_kinds(name: str, value: str, kinds: frozenset[str]) -> frozenset[str]:
    """0 (none), 1 (all), or a comma list of `kinds`. Anything else is none, with a one-line
    warning that says what the variable takes: a typo must not turn a feature on by surprise."""
    v = value.strip().lower()
    if v in ("", "0", "off", "none"):
        return frozenset()
    if v in ("1", "all", "on"):
        return kinds
    got = frozenset(p.strip() for p in v.split(","))
    if not got <= kinds:
        choices = ", ".join(["0", "1", *sorted(kinds)])
        warnings.warn(f"{name}={value!r} not understood ({choices}): off", stacklevel=3)
        return frozenset()
    return got
