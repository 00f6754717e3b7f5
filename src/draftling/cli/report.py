"""`draftling report`: a training run's report, from its files."""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def add_parser(sub) -> None:
    """`draftling report`: a training run's report, from its files."""
    p = sub.add_parser(
        "report",
        help="write a training run's report: markdown with PNG plots",
        description="Read RUN_DIR (metrics.jsonl, and train_result.json once the run has finished) "
        "and write report.md with PNG plots: loss and per-step accuracy over training, the smoke "
        "bench's tau per workload against the epoch fraction (train.smoke_every), the convergence "
        "verdict, and wall time and tok/s for each segment of a resumed run. Reads files only: no "
        "target, no GPU; works on a run still in progress.",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory of `draftling train` (its --run-dir)")
    p.add_argument(
        "--out",
        metavar="DIR",
        help="where to write report.md and the plots (default RUN_DIR/report); "
        "those files are replaced, nothing else in DIR is touched",
    )


def run(args) -> None:
    from draftling.train.report import write_report

    out = write_report(args.run_dir, args.out)
    log.info(f"wrote {out / 'report.md'}")
