import logging
import os
import sys

from psring.workers.entry import main

try:
    code = main()
except SystemExit as e:  # SIGTERM handler, argparse
    code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
logging.shutdown()
sys.stdout.flush()
sys.stderr.flush()
# Leave without running interpreter finalization: after a clean teardown, the C++
# static destructors of torch.distributed's gloo backend occasionally abort the process
# ("terminate called without an active exception", no Python frame on the stack; about
# 1 run in 30 on a loaded 2-core machine), turning a finished run into a failure. By
# now every file the run keeps was written atomically and closed.
os._exit(code)
