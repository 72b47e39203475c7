"""psring's tests, in folders by kind (``make test`` runs them all, from any directory):

- unit/: in one process (a fresh interpreter at most, to look at its imports or memory);
- multiproc/: start psring's processes: runs through the CLI, servers, the launcher,
  forked workers, sweeps;
- emulation/: files with tests that build emulated clusters (network namespaces): the
  emulator itself, multi-host torchrun, the strategies that need several hosts;
- fuzz/: hostile input to the wire protocol (hypothesis, and atheris when installed);
- package/: the repository and the wheel as shipped (layout rules, install and run).

``make test`` runs every folder but emulation/ two tests at a time (pytest-xdist), then
emulation/ one test at a time (tests/conftest.py marks it ``serial``): its tests time
what crosses emulated links, which a neighbour on the 2 cores would skew.

Shared helpers: tests/helpers (``from tests.helpers import ...``); fixtures and hooks:
tests/conftest.py; the test plugin strategies: tests/plugins (put on PYTHONPATH by
``env_with_plugins``).
"""
