"""Tools around the pipeline: the command line, ``explain``, the analytic ``estimate``, reports, sweeps and plots."""
