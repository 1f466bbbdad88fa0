"""``afd run``: the whole system on one machine -- attention replicas and FFN ranks as
processes, a prefill workload, verified outputs, and async vs sync vs colocated.

As a library: a :class:`~afd_tools.run.job.RunJob` says what to run,
:func:`afd_tools.run.api.run_job` runs it and returns the typed
:class:`~afd_tools.prefill.run_report.RunReport`. Inside, the job is planned for this
machine (:mod:`~afd_tools.run.plan`), its launches built and run
(:mod:`~afd_tools.run.launches`), and every output verified (:mod:`~afd_tools.run.verify`);
:mod:`~afd_tools.run.command` is the command line over it."""
