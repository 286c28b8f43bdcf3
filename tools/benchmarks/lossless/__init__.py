"""`prunepipe bench lossless`: Full at several seeds against Random, InfoBatch and TED at equal passes
and at equal compute. plan.py says what runs, run.py trains and times them, verdicts.py judges,
report.py writes each suite's tables (docs/benchmarks/lossless_MODE.md) and plots."""
