"""``afd bench``: micro and layer benchmarks. Each prints a table with its floor measured
in the same run, so ratios are side by side on the same machine."""
