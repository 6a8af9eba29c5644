"""Load generators, ablations, baselines, microbenchmarks and reports."""
