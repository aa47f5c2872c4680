"""The save and load paths: DCP's StorageWriter/AsyncStager and StorageReader, the planner, lazy snapshots, the commit, compression and verification."""
