"""The `pagedserve serve` process: its command line (`cli`), the checks before it starts
anything (`preflight`), what it runs on the machine when the user does not say
(`node_layout`), Ray's start-up deadlines (`ray_startup`), its life once the checks passed
(`process`) and what it watches while it runs (`process_watch`).
"""
