"""Hardware profiles (``profiles/*.toml``: peaks and achieved figures, each with its source),
their loading and validation (``profile``), and the calibration of this machine
(``calibrate``)."""

from refdl.hw.profile import DeviceSpec, HardwareProfile, LinkSpec, dumps, load, names, parse

__all__ = ["DeviceSpec", "HardwareProfile", "LinkSpec", "dumps", "load", "names", "parse"]
