"""Tools around the core: estimator, planner, bench, demo, CLI, communication counter."""
