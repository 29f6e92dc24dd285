"""Counting what a pass over records kept and what it skipped, by reason, with first locations.

Used for the build report (records read / samples written / skipped) and for preprocessing
drops, so that nothing is ever lost without a count.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterable
from typing import IO

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
    samples written, records skipped); ``set_aside`` labels what ``set_aside`` counts: things
    met that are not items (a tar's members that belong to no sample), outside the totals.
    ``every_skip``: a file that every skip is also written to, a JSON line each (``reason``,
    ``location``, ``detail``): the list in full, where ``to_dict`` keeps the first few.
    """

    def __init__(self, seen: str = "seen", kept: str = "kept", skipped: str = "skipped",
                 set_aside: str = "set_aside", every_skip: IO[str] | None = None):
        self.names = (seen, kept, skipped, set_aside)
        self.every_skip = every_skip
        self.seen = 0
        self.kept = 0
        self.skipped: dict[str, dict] = {}
        self.aside: dict[str, dict] = {}
        self.counts: dict[str, int] = {}   # what the kept items hold, by name (where not 0)

    def count(self, name: str, number: int) -> None:
        """Add ``number`` to the count of ``name`` (something kept items hold, e.g. answers
        out of the loss), which ``to_dict`` and ``summary`` then report."""
        if number:
            self.counts[name] = self.counts.get(name, 0) + number

    def keep(self, count: int = 1) -> None:
        self.seen += count
        self.kept += count

    def skip(self, reason: str, location: str, detail: str,
             record_id: str | None = None) -> None:
        """One skip; ``record_id``: the record's own id, where it has one (said beside its
        location, to find it in the user's data)."""
        self.skip_many(reason, 1, [(location, detail, record_id)])

    def skip_many(self, reason: str, count: int,
                  first: Iterable[tuple[str, str] | tuple[str, str, str | None]]) -> None:
        """``count`` skips for ``reason``, the first ones as ``(location, detail)`` (or with
        the record's id); where the skips are written to ``every_skip``, ``first`` gives every
        one (read as it is written: a generator holds none of them)."""
        self.seen += count
        entries = map(_entry, first)
        head = list(itertools.islice(entries, FIRST_LOCATIONS))
        _add(self.skipped, reason, count, head)
        if self.every_skip is None:
            return
        written = 0
        for entry in itertools.chain(head, entries):
            self.every_skip.write(json.dumps({"reason": reason, **entry},
                                             ensure_ascii=False) + "\n")
            written += 1
        if written != count:
            raise ValueError(f"{count} {reason} skips counted, {written} listed: every one is "
                             "given where every skip is written")

    def set_aside(self, reason: str, location: str, detail: str) -> None:
        """One thing that is not an item, left out for ``reason`` (counted apart from the
        items seen and skipped)."""
        _add(self.aside, reason, 1, [_entry((location, detail))])

    @property
    def skipped_total(self) -> int:
        return sum(entry["count"] for entry in self.skipped.values())

    def to_dict(self) -> dict:
        seen, kept, skipped, aside = self.names
        return {seen: self.seen, kept: self.kept, skipped: self.skipped_total,
                "skipped_by_reason": dict(sorted(self.skipped.items())),
                **({f"{aside}_by_reason": dict(sorted(self.aside.items()))} if self.aside
                   else {}),
                **({"counts": dict(sorted(self.counts.items()))} if self.counts else {})}

    def summary(self) -> str:
        """One line for people: totals and skip counts by reason."""
        seen, kept, skipped, aside = (name.replace("_", " ") for name in self.names)
        line = f"{_count(self.seen, seen)}, {_count(self.kept, kept)}"
        if self.counts:             # what the kept items hold, beside them
            line += " (" + ", ".join(f"{name.replace('_', ' ')}: {number}"
                                     for name, number in sorted(self.counts.items())) + ")"
        if self.skipped:
            line += f", {_count(self.skipped_total, skipped)} ({_reasons(self.skipped)})"
        if self.aside:
            line += (f", {_count(sum(e['count'] for e in self.aside.values()), aside)} "
                     f"({_reasons(self.aside)})")
        return line


def _entry(item: tuple[str, str] | tuple[str, str, str | None]) -> dict[str, str]:
    """A skip as reported: its location, the record's id where it has one, the detail."""
    location, detail, *record_id = item
    return {"location": location, **({"id": record_id[0]} if record_id and
                                     record_id[0] is not None else {}), "detail": detail}


def _add(by_reason: dict[str, dict], reason: str, count: int,
         first: list[dict[str, str]]) -> None:
    entry = by_reason.setdefault(reason, {"count": 0, "first": []})
    entry["count"] += count
    entry["first"].extend(first[:FIRST_LOCATIONS - len(entry["first"])])


def _reasons(by_reason: dict[str, dict]) -> str:
    return ", ".join(f"{reason} {entry['count']}" for reason, entry in sorted(by_reason.items()))


def _count(number: int, label: str) -> str:
    """``number`` and its ``label`` ("records read"), whose first word is singular for 1."""
    noun, _, rest = label.partition(" ")
    if number == 1 and noun.endswith("s"):
        noun = noun[:-1]
    return f"{number} {noun}" + (f" {rest}" if rest else "")
