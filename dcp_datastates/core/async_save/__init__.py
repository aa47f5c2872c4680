"""Asynchronous saves: ``DataStatesWriter.stage()`` up to the save that writes the snapshot.

``snapshot`` (a rank's lazy copy of a state dict), ``handoff`` (the staging
future and a writer's snapshots: which save writes which snapshot), ``order``
(the process-wide order of saves), ``fence`` (the pre-hooks that wait for
copies in flight) and ``runtime`` (what they share in a process, and the one
fork hook).
"""
