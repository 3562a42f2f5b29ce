"""Plumbing with no RL in it: collectives over ranks, the C heap, worker processes, Lightning internals touched in one
place (:mod:`~logra_pl.runtime.compat`), console noise, activation checkpointing."""
