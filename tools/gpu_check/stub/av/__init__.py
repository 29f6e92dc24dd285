"""Stand-in for PyAV on the GPU check's machine: importing works, using it raises.

``mimo_data.modalities`` imports ``av`` when it loads, but only video decodes with it; the
check trains on images, and PyAV's wheel (FFmpeg inside) is half of what a device call carries.
"""
__version__ = "0+stub"


def __getattr__(name):
    raise ImportError(f"av.{name}: PyAV is not installed on this machine (image-only run)")
