"""The data-parallel front end (`blockserve serve --data-parallel-size N`): one HTTP server
that starts N engine replicas (replicas.py), routes each request by prefix affinity and load
(routing.py), relays it (router.py) and merges the replicas' metrics (metrics.py)."""
