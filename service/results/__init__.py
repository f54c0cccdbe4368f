"""The results home: everything that happens to a run's measurements after the run ends.

The path of a result, in order:

- write: the scheduler (the one writer) maps a workers.results.RunOutcome onto rows and writes
  them in one transaction while it holds the run's lease (completion_from_outcome, finish).
- queries: the reads of stored results (rank results, probes, components, steps, artifacts,
  environments) and a sweep's rows, whole or a page at a time.
- rows: RunRow, the one read model: every number a page, a CSV or the report shows is a field
  of it; rows_build computes them once from the stored columns.
- baselines: what compares rows with each other (speedups, efficiency, labels, pivots, flags).
- export: results.json / results.csv / components.csv / pivot.csv columns, picked from the rows.
- report: report.md, its sections in report_runs, report_baseline, report_training and
  report_environment, their formatting in report_format; schemes: its sequence-parallel
  schemes section; peaks: GPU peak FLOP/s.
- charts and compare: the dashboard's figures and its compare page's logic.
- service: what the API's results routes render (report.md, the CSVs, a comparison), each
  reading its sweep once.
- trackers: the same records sent to MLflow, Weights & Biases or TensorBoard.

service/api and service/web keep routes and templates; they import from here, never the reverse.
"""
