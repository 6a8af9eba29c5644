"""A worker process on its machine: which cores it runs on and at what priority
(`cpu_placement`), SIGTERM as a drain (`drain_signal`), the pid files that list the workers
of a machine (`pid_files`) and `pagedserve drain-node` (`drain_node`).
"""
