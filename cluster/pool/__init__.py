"""The worker pool, the one owner of which workers an app runs: the pool actor (`pool`, and
how a worker leaves it: `leaving`) and its Ray-free decisions (`planner`), membership and what
it publishes (`members`, `types`), a router replica's side of it (`follower`), what it reads
of the app config (`config`: `PoolConfig`), what a worker is built from (`spec`), the named
actors of an app (`group`), and KV moved between workers: migration and a leaving worker's
cache handover.
"""
