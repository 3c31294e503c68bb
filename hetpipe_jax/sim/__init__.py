"""The discrete-event engine over the shared rules, what runs it (in-flight memory peaks), its report, traces and
Gantt charts (no jax)."""
