"""Tests in one process: no psring process started."""
