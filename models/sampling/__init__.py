"""Per-request sampling: logit processors, filters, seeded streams, grammar masks."""
