"""Transports: how learner and syncer messages travel (in-process, gRPC, emulated links)."""
