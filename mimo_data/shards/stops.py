"""How a build or an indexing stops short of a dataset (``mimo-shard`` maps each to its exit
status): shared by the builders, the in-place indexer and the output folder's swap."""


class BuildError(Exception):
    """The build stopped (bad output dir, unreadable input, or --strict on a bad record)."""


class StrictStop(BuildError):
    """``--strict`` stopped the build at a bad record (the data failed, not the call)."""


class OutputFull(BuildError):
    """The disk a build or an indexing wrote to filled up (the work failed, not the call)."""
