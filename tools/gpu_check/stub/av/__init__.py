"""Stand-in for PyAV on the GPU check's machine: importing works, using it raises.

``mimo_data.modalities`` imports ``av`` when it loads, but only video decodes with it. The
check carries PyAV's wheel in ``.whl/`` (prepare.sh) and installs it; where it was not carried,
this stands in and the check's shards hold no clips.
"""
__version__ = "0+stub"


def __getattr__(name):
    raise ImportError(f"av.{name}: PyAV is not installed on this machine (image-only run)")
