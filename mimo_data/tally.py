"""Counting what a pass over records kept and what it skipped, by reason, with first locations.

Used for the build report (records read / samples written / skipped) and for preprocessing
drops, so that nothing is ever lost without a count.
"""

from __future__ import annotations

FIRST_LOCATIONS = 5  # offending locations kept per reason


class CountedError(Exception):
    """An item that is skipped and counted rather than crashing the pass: ``reason`` is its
    report category, ``detail`` says what is wrong and what to do."""

    def __init__(self, reason: str, detail: str):
        super().__init__(detail)
        self.reason = reason
        self.detail = detail

    def __reduce__(self):
        # rebuilt from both arguments (Exception's pickling passes ``args``, the detail alone):
        # one raised in a worker process reaches the caller as itself
        return type(self), (self.reason, self.detail)


class Tally:
    """Items seen = kept + skipped; skips are counted by reason with their first locations.

    ``names`` label the three totals in ``to_dict`` and ``summary`` (e.g. records read,
    samples written, records skipped).
    """

    def __init__(self, seen: str = "seen", kept: str = "kept", skipped: str = "skipped"):
        self.names = (seen, kept, skipped)
        self.seen = 0
        self.kept = 0
        self.skipped: dict[str, dict] = {}
        self.counts: dict[str, int] = {}   # what the kept items hold, by name (where not 0)

    def count(self, name: str, number: int) -> None:
        """Add ``number`` to the count of ``name`` (something kept items hold, e.g. answers
        out of the loss), which ``to_dict`` and ``summary`` then report."""
        if number:
            self.counts[name] = self.counts.get(name, 0) + number

    def keep(self, count: int = 1) -> None:
        self.seen += count
        self.kept += count

    def skip(self, reason: str, location: str, detail: str) -> None:
        self.skip_many(reason, 1, [(location, detail)])

    def skip_many(self, reason: str, count: int, first: list[tuple[str, str]]) -> None:
        """``count`` skips for ``reason``, the first ones as ``(location, detail)``."""
        self.seen += count
        entry = self.skipped.setdefault(reason, {"count": 0, "first": []})
        entry["count"] += count
        entry["first"].extend({"location": location, "detail": detail} for location, detail
                              in first[:FIRST_LOCATIONS - len(entry["first"])])

    @property
    def skipped_total(self) -> int:
        return sum(entry["count"] for entry in self.skipped.values())

    def to_dict(self) -> dict:
        seen, kept, skipped = self.names
        return {seen: self.seen, kept: self.kept, skipped: self.skipped_total,
                "skipped_by_reason": dict(sorted(self.skipped.items())),
                **({"counts": dict(sorted(self.counts.items()))} if self.counts else {})}

    def summary(self) -> str:
        """One line for people: totals and skip counts by reason."""
        seen, kept, skipped = (name.replace("_", " ") for name in self.names)
        line = f"{self.seen} {seen}, {self.kept} {kept}"
        if self.skipped:
            reasons = ", ".join(f"{reason} {entry['count']}"
                                for reason, entry in sorted(self.skipped.items()))
            line += f", {self.skipped_total} {skipped} ({reasons})"
        if self.counts:
            line += "; " + ", ".join(f"{number} {name.replace('_', ' ')}"
                                     for name, number in sorted(self.counts.items()))
        return line
