"""Tests that start psring processes: CLI runs, servers, the launcher, forking, sweeps."""
