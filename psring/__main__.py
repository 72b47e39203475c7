from psring.cli import entry

entry()
