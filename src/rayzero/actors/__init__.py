"""Self-play and evaluation roles (plain classes; `cluster/` makes them Ray actors)."""
