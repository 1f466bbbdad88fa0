"""``afd sim``: a discrete-event model of A attention replicas and F FFN ranks.

The model runs the same workloads and batching as ``afd run`` (it reuses
:mod:`afd_tools.prefill.workload`) through per-layer costs read from a calibration file
(:mod:`afd_tools.sim.costs`), in the three modes of ``afd run``, so that A:F ratios and GPU
counts beyond the hardware at hand can be explored -- and checked against the runs that
can be made (``docs/sim.md``).
"""
