"""The registry's log wing: the transparency log and everything that signs, orders or watches it.

- ``tree.py``: the in-memory Merkle tree, its signed checkpoints and proofs;
- ``signedhead.py``: the tree head kept outside the database, so a rolled-back database is refused;
- ``sequencer.py``: the thread that appends verified publishes in batches;
- ``cluster.py``: the sequencer lease of several server processes on one PostgreSQL database;
- ``cosignatures.py``: witness cosignatures, collected in the background and stored.

It imports the storage wing, never the service (``service.Registry``): where it drives the
registry it names it through a protocol (``cluster.LogFollower``, ``cosignatures.CheckpointSource``).
"""
