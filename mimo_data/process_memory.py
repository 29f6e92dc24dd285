"""This process's memory as Linux's ``/proc/self/status`` gives it: the run's CPU memory figure
and the tools' measurements read it here."""

from __future__ import annotations


def status_bytes(*fields: str) -> dict[str, int]:
    """The ``fields`` of /proc/self/status (``VmRSS``, ``VmHWM``, ``RssFile`` ...) in bytes.
    Raises OSError where there is no /proc, KeyError naming a field the kernel does not give."""
    found = {}
    with open("/proc/self/status") as status:
        for line in status:
            key, _, value = line.partition(":")
            if key in fields:
                found[key] = int(value.split()[0]) * 1024
    missing = [field for field in fields if field not in found]
    if missing:
        raise KeyError(f"/proc/self/status has no {', '.join(missing)}")
    return found
