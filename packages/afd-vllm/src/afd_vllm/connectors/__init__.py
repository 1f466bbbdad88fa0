"""afd's connectors for vLLM: thin adapters that open an afd :class:`~afd_protocol.Connection`
for this process's role and rank; the engine then talks to the endpoint protocols only.
Each backend is imported only when its connector is selected (:mod:`.factory`)."""
