"""A script that ends as scripts do, for psring launch's forked workers (tests/multiproc/
test_script_runs.py): its exit handler runs, its ``sys.exit("...")`` message is shown,
and it sees ``__file__`` and ``sys.path[0]`` as `python script_exits.py` shows them."""

import atexit
import os
import sys

atexit.register(lambda: print("exit handler ran", file=sys.stderr))
print(f"file absolute: {os.path.isabs(__file__)}; "
      f"path[0] is its folder: {sys.path[0] == os.path.dirname(os.path.abspath(__file__))}",
      file=sys.stderr)
sys.exit("a message for the user")
