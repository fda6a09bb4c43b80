"""The durable cache manager (`--state-dir DIR`): what the server needs of it.

state.py owns the state dir (recovery, journaling, snapshots); journal.py is the record log,
snapshot.py turns a pool into plain data and back, replay.py says what each record means.
"""

from cache_service.durable.state import DEFAULT_FSYNC_SECONDS, DEFAULT_SNAPSHOT_BYTES, DurableState

__all__ = ["DEFAULT_FSYNC_SECONDS", "DEFAULT_SNAPSHOT_BYTES", "DurableState"]
