"""Network lab: local processes on a real, rate-shaped network (namespaces, veth, bridge, tbf).

Example:
  >>> from experiments.netlab import Lab
  >>> with Lab(2, "100mbit") as lab:  # doctest: +SKIP
  ...     argv = lab.command(0, ["ping", "-c1", lab.address(1)])
"""

from experiments.netlab.lab import Lab, LabError, cleanup, default_burst, parse_rate, parse_size

__all__ = ["Lab", "LabError", "cleanup", "default_burst", "parse_rate", "parse_size"]
