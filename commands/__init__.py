"""The `k2deploy` command line and the quickstart: what a user runs, over the core, export and runtime packages."""
