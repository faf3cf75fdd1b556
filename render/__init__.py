"""decompax.render: figures and report pages built from a run's records.

The run figures and an attribution graph's (`figures`), the static run
report (`run_report`) with its part-of-speech section (`tag_report`), and a
targeted run's A/B grid page (`ab_grid`). Each builds its matplotlib figure
or page text here and hands it to `io.report_files`, which writes it
atomically; nothing here opens a file for writing. Imports `core`,
`measures` and `io`.
"""
