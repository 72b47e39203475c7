"""Reports: ``psring report DIR``.

On run directories, a table of their summaries (psring.report.runs); on a sweep
directory, report.md, report.json and PNG plots (psring.report.markdown). A sweep's
report flows through the package's modules in this order:

- ``points``: each finished point read back from its logs (steps.jsonl, manifest.json,
  evals.jsonl), and the points that failed or did not run;
- ``aggregate``: points grouped into settings (:class:`~psring.report.aggregate.Setting`):
  medians and ranges over repeats, the cost model's and the simulator's predictions
  (psring.predict), speedups, scaling efficiency, time to accuracy, crossovers;
- ``faults``: what a fault cost a run (recovery, steps redone, throughput, time to
  accuracy with the time lost), for the sweep's Faults section;
- ``cluster``: where a point ran, in words;
- ``plots``: the PNG figures (matplotlib, imported only when drawing);
- ``markdown``: report.md, report.json and the key table.
"""

from psring.report.markdown import write_report
from psring.report.runs import render_table, summarize, summarize_all

__all__ = ["render_table", "summarize", "summarize_all", "write_report"]
