"""Parameter-server processes (installed as ``psring.servers``).

The parameter-server strategies (``ps``, ``async-ps``) arrive with issue 3; this
package is where their server process lives.
"""
