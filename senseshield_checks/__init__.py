"""Independent checks on SenseShield's own measurements.

Code here re-does something the project already measures, written separately so that the
two can be compared. It is not part of the privacy engine and nothing in ``senseshield``
imports it.

* :mod:`senseshield_checks.dlg`: Deep Leakage from Gradients (Zhu, Liu and Han, NeurIPS
  2019), a second gradient-inversion attack beside ``senseshield.attacks`` (issue 16,
  item 3); benchmark ``benchmarks/bench_dlg.py``.
"""
