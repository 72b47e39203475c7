"""Hostile input to the wire protocol; fuzz_protocol.py is atheris's harness (run it by hand)."""
