"""Tests with emulated clusters (network namespaces); skipped where a machine cannot build one."""
