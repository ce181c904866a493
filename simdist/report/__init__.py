"""``python -m simdist.report PATH... [--out DIR]``: an HTML page of plots for runs and plans.

Each PATH is a ``model_dir`` a training run left (``performance.json`` required; the loss
comes from its TensorBoard event files, else from ``run.log``; ``eval.json``,
``params.yaml`` and ``timeline.json`` are used where present) or a JSON file written by
``python -m simdist.plan ... --json`` (one configuration, or any list of them: a ranked
search result renders as a ranked table). The page, ``DIR/report.html`` (default
``report/``), embeds every PNG as a data URI so it can be mailed on its own; each figure is
also written beside it as ``<name>.png`` plus ``<name>.json``, the exact series drawn (see
``simdist.plots``), and ``report.json`` indexes the inputs and figures.

For runs: loss (and validation) curves, measured vs simulated samples/s, the simulated step
split into compute / exposed communication / other, device memory by category against the
device's capacity. Runs of one model (same ``model`` params and device profile) at two or
more world sizes also get a scaling plot: throughput and efficiency against ranks, measured
and simulated. Plans: a table of the configurations in their given (ranked) order, their
memory and step breakdown, and a scaling curve of the best configuration per device count
when the plans span several.

Exit codes: 0 done, 2 bad input (a path that is neither, a model_dir without
performance.json, unreadable JSON) or matplotlib missing (``pip install simdist[report]``).
"""

from simdist.report.figures import build_plots
from simdist.report.inputs import PlanData, ReportError, RunData, load_input
from simdist.report.page import main, write_report

__all__ = [
    "ReportError",
    "RunData",
    "PlanData",
    "load_input",
    "build_plots",
    "write_report",
    "main",
]
