"""What the bench suites share: reports and plots, process memory sampling, sim runs, broker
byte counters, realistic device messages, the central upper bound and hand-driven rogue
devices. The suites themselves are the modules of bench/ (bench/cli.py lists them)."""
