"""Reports: the tables, CSV files and figures made from finished results folders.

One module per report, each in four steps: compute (a pure function of a loaded run,
returning arrays and dicts), write (CSV / JSON under the run folder), print, plot.
`common` holds what they share. Nothing outside `jaxmech.reports` imports this package
(the thin entry points in `experiments/` do); importing it loads no report.
"""
