"""The discrete-event engine over the shared rules, its report, task times, traces and Gantt charts (no jax)."""
