"""The prefill job as ``afd run`` and ``afd sim`` both see it: workloads and FCFS chunking
(:mod:`.workload`), per-mode metrics (:mod:`.metrics`), the per-layer time breakdown
(:mod:`.layer_times`), the printed report and timeline (:mod:`.report`), and the command-line
options that describe a workload and a wire format (:mod:`.options`). It imports neither the
runtime (:mod:`afd_tools.run`) nor the simulator (:mod:`afd_tools.sim`)."""
