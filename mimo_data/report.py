"""The build report: every record read is either written or skipped for a counted reason."""

from __future__ import annotations

FIRST_LOCATIONS = 5  # offending locations kept per reason


class BuildReport:
    """Counts records read / written / skipped, with the first locations of each skip reason."""

    def __init__(self):
        self.read = 0
        self.written = 0
        self.skipped: dict[str, dict] = {}

    def wrote(self) -> None:
        self.read += 1
        self.written += 1

    def skip(self, reason: str, location: str, detail: str) -> None:
        self.read += 1
        entry = self.skipped.setdefault(reason, {"count": 0, "first": []})
        entry["count"] += 1
        if len(entry["first"]) < FIRST_LOCATIONS:
            entry["first"].append({"location": location, "detail": detail})

    @property
    def skipped_total(self) -> int:
        return sum(entry["count"] for entry in self.skipped.values())

    def to_dict(self) -> dict:
        return {"records_read": self.read, "samples_written": self.written,
                "records_skipped": self.skipped_total,
                "skipped_by_reason": dict(sorted(self.skipped.items()))}

    def summary(self) -> str:
        """One line for people: totals and skip counts by reason."""
        line = f"read {self.read} records, wrote {self.written} samples"
        if self.skipped:
            reasons = ", ".join(f"{reason} {entry['count']}"
                                for reason, entry in sorted(self.skipped.items()))
            line += f", skipped {self.skipped_total} ({reasons})"
        return line
