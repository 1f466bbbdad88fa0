"""``afd run``: the whole system on one machine -- attention replicas and FFN ranks as
processes, a prefill workload, verified outputs, and async vs sync vs colocated."""
