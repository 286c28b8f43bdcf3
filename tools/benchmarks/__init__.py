"""Measurements run by hand, each printing ratios measured side by side in one run: lossless/ (pruned
against full runs), the data path (stream, shard tools, remote reads, encode ranks), the pruners and the
loop's overhead, dedup quality and scale; and the checks of a change as a cluster would run it
(rehearse_cluster.py, resume_check.py, allreduce_count.py, gpu_report.py for tools/gpu_check.sh)."""
