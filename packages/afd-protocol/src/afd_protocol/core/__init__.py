"""The contract core: what every engine and every transport agrees on.

Pure Python on torch tensors, with no window, kernel, shared-memory or GPU code: topology,
slot and window geometry, the header codec, dispatch plans and the weighted combine, work
items, the endpoint protocols and their options, the FFN serving loop, the rendezvous,
and the errors. ``afd_protocol`` re-exports its public names.
"""
