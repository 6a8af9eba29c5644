"""Which worker serves a request: what a routing policy reads and returns (`policy`), the
policies one family per module (`kv_aware`, `baselines`) and their registry (`policies`), the
routable workers ranked by a policy and kept current (`routable`, `load_ranking`), what a prefix
hit below the device costs (`tier_costs`) and where each P/D phase may run (`worker_roles`).
"""
