"""Ray Serve deployment parts: the scheduler actor, routing and affinity, the ingress, events, metrics, readiness."""
