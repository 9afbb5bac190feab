"""The run report (``quant_report.json``): its data model, written by every run; the hashes it
records; rendering as a table or an HTML page; reading it back; and the regression gate that
compares a run with a baseline report."""
